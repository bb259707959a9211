"""Localisation: where do two runs of one model first diverge?

``dmlib.capture`` (capture.py) hooks named torch modules and records, for every tensor
entering or leaving them, its SHA-256 whole and per logical request in blocks of
positions, dumping full tensors only where asked; ``dmlib.open_capture`` (captures.py)
reads a capture without torch; ``dmlib.compare_captures`` (boundaries.py) compares two
captures boundary by boundary, names the culprit (inputs identical, output differs) and
reports the repeat and negative controls that qualify the verdict.

With ``ops=True`` the capture also records every op inside chosen modules (ops.py, which
also aligns two runs' op sequences); ``dmlib.patch_test`` (patch.py) checks that the
culprit causes the downstream difference, ``dmlib.arbitrate`` (arbitrate.py) measures both
runs of a culprit op against its float64 replay, and ``dmlib.repeat_study`` (rates.py)
gives how often repeats differ with Wilson intervals and an observer (capture on/off) arm.
"""
