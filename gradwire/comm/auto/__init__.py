"""`auto`: the exchange chosen per bucket by cost models, then by a timed trial.

- probe.py: measuring the links (alpha, beta) and a compressor's encode/decode cost;
- policy.py: choosing among candidates' times (near-ties to the exchange that changes training least);
- turns.py: candidates exchanging real buckets in timed turns, the ranks agreeing on the means;
- uncompressed.py: the faster of dense and bf16 per bucket, for the hook's uncompressed first steps;
- strategy.py: the `Auto` strategy, which asks each candidate strategy for its own modelled cost.

Tests: tests/comm/test_auto.py.
"""

from .policy import APPROXIMATE, APPROXIMATE_GAIN, MARGIN, PREFERENCE, TRIAL_CLOSE, TRIAL_MARGIN, prefer
from .probe import agreed, measure, measure_compute
from .strategy import Auto
from .turns import Phase, TimedTurns
from .uncompressed import FasterUncompressed

__all__ = ["Auto", "FasterUncompressed", "TimedTurns", "Phase", "prefer", "measure", "measure_compute", "agreed",
           "PREFERENCE", "APPROXIMATE", "MARGIN", "TRIAL_MARGIN", "TRIAL_CLOSE", "APPROXIMATE_GAIN"]
