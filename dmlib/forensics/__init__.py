"""Structure-aware forensics: judge tensors by the structure that produced them.

- :mod:`dmlib.forensics.columns`: first divergent column (for a Householder QR's Q, the
  iteration at which two runs first disagreed), column cosines, sign flips.
- :mod:`dmlib.forensics.factors`: factorised layers compared by their effective weights.
- :mod:`dmlib.forensics.ladder`: divergence along a step ladder, growth per step, and
  checks that each checkpoint really is the step it is claimed to be.
"""
