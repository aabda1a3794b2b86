"""The ``auto`` schedule: a cost-aware search over op orders, with the simulator as objective.

The hand schedules assume every stage costs the same and a hop is free. Real pipelines have a
heavy last stage (head, loss, MTP), an embedding-heavy first stage, point-to-point latency and
exposed all-to-all. ``auto`` builds orders for the measured ``Costs`` instead:

* ``search``: the heuristic driver — hand schedules as candidates, list scheduling, randomised
  walks, local search, then an FB polish (backwards split into B + W, W's sunk to the cool-down,
  FB-specific moves) where FB units can pay; ``build`` registers ``build_schedule("auto", ...)``;
* ``cpsat``: the exact backend (``solver="cpsat"``, optional OR-Tools), warm-started from the
  heuristic's best, returning a proven lower bound;
* ``policies``: the decisions a list-scheduling walk can take, and the grid tried;
* ``listsched``: one greedy, event-driven walk (gather candidates -> choose -> apply);
* ``local``: hill climbing and simulated annealing on per-rank orders with named moves;
* ``bound``: a makespan no schedule can beat (work and paths, and the F's that cannot be paired),
  what ``meta["lower_bound"]`` reports unless CP-SAT proves a better one;
* ``layout``: the per-rank view of a placement from ``schedules.placements``.

``memory_limit=None`` means the peak activations of the *lowest-memory* hand schedule of that
placement (P for linear: 1f1b / zb-h1; 2P for v: zbv; P+1 for dual: dualpipe). Peaks are counted
as the simulator counts them (+1 when a stage's F starts, -1 when its W or BW ends), per rank;
see docs/schedules.md.
"""

from .bound import lower_bound, unpaired_bound, work_bound
from .build import build_auto
from .layout import PLACEMENTS, Layout, memory_limits
from .listsched import Choice, list_schedule
from .local import ANNEAL_MOVES, ANNEAL_PLAIN_MOVES, FB_MOVES, MOVES, anneal, evaluate, local_search, split_backward
from .policies import Policy, policies
from .search import HAND_SCHEDULES

__all__ = ["build_auto", "lower_bound", "unpaired_bound", "work_bound", "Layout", "PLACEMENTS", "memory_limits",
           "Choice", "list_schedule", "MOVES", "FB_MOVES", "ANNEAL_MOVES", "ANNEAL_PLAIN_MOVES", "anneal", "evaluate",
           "local_search", "split_backward", "Policy",
           "policies", "HAND_SCHEDULES"]
