"""Criteria: what one recipe sentence demands of a run, and its verdict on a run's data.

A :class:`Criterion` is one ``[[criterion]]`` table of a tier spec (``harness/spec/*.toml``); its ``kind``
says how it is judged. Kinds and their parameters (besides the common ``id``, ``kind``, ``metric``, ``doc``,
``window``, ``profile``):

====================  ===============================================================================
kind                  parameters
====================  ===============================================================================
band                  ``lo``, ``hi`` (either may be left out), ``reduce`` = each | mean, ``n`` with
                      ``lo_count`` / ``hi_count`` (judge as solved counts of ``n``)
rise_by               ``min_rise``; ``n`` with ``min_rise_count``; window = [from, to] (to −1: the last)
returns_to_baseline   ``tolerance_gb``, ``phase``, ``side`` = both | above, ``baseline_gb`` (absolute),
                      ``min_syncs``; per rank, per sync; baseline = the rank's first reading in the window
                      after its attempt's first optimizer step; startup syncs (before it) only not above
no_growth             ``max_slope_gb_per_sync``, ``phase``, ``min_points``; least-squares slope per rank of
                      the readings after training, each relative to its attempt's baseline
config_equals         ``value``: the resolved value of the config name in ``metric``, as Megatron prints it
cycle_time_within     ``lo``, ``hi``, ``unit`` = s | min, ``allowed_outside``; see :mod:`harness.cycles`
completes_within      ``max_minutes``, ``min_rollouts``: from the ``started`` to the ``finished`` status,
                      summed over attempts (a resumed run's downtime is not run time)
advances              ``step``: the adapter version goes up by exactly ``step`` at every sync; an
                      attempt's first sync delivers the saved version + ``step`` after a resume (1 after
                      a start over). ``metric`` ``adapter/engine_version``: the version the engine
                      reported active (else ``adapter/version``, the one the trainer sent)
replicas_agree        ``min_steps``: after every optimizer step, every replica of an adapter tensor (same
                      label on several ranks) has the same digest; FAIL names the first step, the tensor
                      and the ranks on each side
delivered             ``min_syncs``: at every sync each engine reports the sent version active and, for
                      every chunk the trainer sent, the trainer's digest; FAIL names the sync, version,
                      chunk and engine
resident_while_asleep ``max_gb``, ``before_phase`` / ``after_phase`` (the trainer's sleep), ``min_syncs``;
                      per rank and sleep: what its allocator held before (reserved, else allocated) minus
                      what left the device (``metric``: physical, the whole device) ≤ ``max_gb``
released_while_training  ``tag`` (weights), ``min_released_gb``, ``min_rollouts``; per engine and trained
                      rollout: an ``after_release`` of ``tag`` before the train event, no resume before it,
                      and ≥ ``min_released_gb`` of ``metric`` freed by that release
====================  ===============================================================================

``window`` is ``"all"`` or ``[first, last]`` (inclusive; ``last = -1``: open-ended) over rollout ids
(scalars), sync indices (memory, adapter versions) or cycle indices.

Each evaluation is a :class:`Result`: PASS, FAIL, PENDING (not far enough yet: more data can still decide
it) or MISSING (the run is over and the data is not there). ``final`` says whether more data can change
it — a FAIL that is final is what the live watch aborts on. A criterion over an open-ended window is PENDING
until the run is finished, even when every value so far is good.

Evidence rules: a NaN or infinite number a criterion reads (a value, a logged count, a memory reading, a cycle
time) makes it FAIL; an event time that is not a number is dropped by the reader, so what needed it is MISSING.
A weight sync that some rank has no memory reading for makes the memory criteria MISSING (they do not pass on
fewer syncs), and a run that was resumed is judged on every attempt (:mod:`harness.run_data`).

Where each part lives: one module per kind (``band``, ``rise``, ``memory`` for returns_to_baseline and no_growth,
``config_equals``, ``cycle_time``, ``completion``, ``versions`` for advances, ``replicas``, ``delivered``,
``dance`` for the memory dance's two kinds), over ``criterion`` (what a criterion and a verdict are), ``params``
(the parameters' types) and ``scalars`` (series of values and counts); ``kinds`` ties each kind to its parameters
and its spec check, builds criteria from a spec's tables and judges them.
"""

from __future__ import annotations

from harness.criteria.criterion import Criterion, Result, SpecError, Status, Window
from harness.criteria.kinds import KINDS, build_criterion, evaluate, evaluate_all
from harness.criteria.memory import least_squares_slope

__all__ = ["Status", "Window", "Criterion", "Result", "KINDS", "SpecError", "build_criterion", "evaluate",
           "evaluate_all", "least_squares_slope"]
