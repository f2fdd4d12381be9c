"""Deprecated (one release): the old home of the cost model and `auto`, re-exports only.

The alpha-beta link model is links.py; what is worth compressing, base.py; each strategy's
wire model, its own module (`oktopk_seconds`: oktopk.py); measuring, choosing and the `Auto`
strategy, the auto/ package. (Setting a constant here changes nothing: set it in auto/policy.py.)"""

import warnings

from .auto.policy import APPROXIMATE, APPROXIMATE_GAIN, MARGIN, PREFERENCE, TRIAL_CLOSE, TRIAL_MARGIN, prefer
from .auto.probe import measure, measure_compute
from .auto.strategy import Auto
from .base import estimated_packet_bytes, worth_compressing
from .links import CostModel
from .oktopk import oktopk_seconds

warnings.warn("gradwire.comm.cost moved to gradwire.comm.links (the cost model) and gradwire.comm.auto;"
              " this alias goes in the next release",
              DeprecationWarning, stacklevel=2)

__all__ = ["APPROXIMATE", "APPROXIMATE_GAIN", "Auto", "CostModel", "MARGIN", "PREFERENCE", "TRIAL_CLOSE",
           "TRIAL_MARGIN", "estimated_packet_bytes", "measure", "measure_compute", "oktopk_seconds", "prefer",
           "worth_compressing"]
