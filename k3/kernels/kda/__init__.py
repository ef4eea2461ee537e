"""KDA delta-rule core: ``naive`` beside ``chunk`` (torch), ``gate``, the ``fla`` dispatch and its ``tuning``."""
