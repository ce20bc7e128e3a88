"""The distillation methods' vocabulary (``distill=``, conf/distill/), one for the settings' checks (ringdit.spec),
the training module (ringdit.training.distillation_module) and the memory estimate (ringdit.costs)."""

DISTILL_METHODS = ("none", "dmd2", "scm", "rcm")
CRITIC_METHODS = ("dmd2", "rcm")  # those that train a critic (fake score) beside the student
CONSISTENCY_METHODS = ("scm", "rcm")  # sCM's continuous-time consistency loss (a JVP through the student)
