"""Session affinity in the DP simulator (`simulator/offline/dp_sessions.py`, issue 42 item 3): the Mooncake trace's
conversations, and the gateway's sticky-until-saturated rule in front of a real dispatcher."""

from __future__ import annotations

import numpy as np

from switchyard.simulator.offline.dp import Dispatcher
from switchyard.simulator.offline.dp_sessions import conversation_sessions, sticky
from switchyard.solver.routing.dispatch import GimbalParams


def test_a_turn_continues_the_prompt_before_it_but_its_partial_last_block() -> None:
    prompts = [[1, 2, 3], [1, 2, 4, 5], [1, 9], [7], [7, 8], [1, 2, 4, 6, 6]]
    sessions = conversation_sessions([np.array(p) for p in prompts]).tolist()
    # [1,2,4,5] continues [1,2,3] (all but its last block); [1,9] shares only the first block: a new session;
    # [7,8] continues [7]; [1,2,4,6,6] continues [1,2,4,5], the latest turn of the first session
    assert sessions == [0, 0, 1, 2, 2, 0]


def test_a_session_sticks_against_load_until_its_engine_is_saturated() -> None:
    disp = Dispatcher("jsq", 2, GimbalParams(), 0.0)  # least outstanding: it would spread every request
    sessions = np.array([0, 0, -1, 0])
    _choose, counts = sticky(disp, sessions, limit=2)
    first = disp.choose(0.0, 100, None, 0)
    assert disp.choose(0.1, 100, None, 1) == first  # held, though the other engine is idle ...
    other = disp.choose(0.2, 100, None, 2)
    assert other != first  # ... where a request naming no session goes (the control)
    assert disp.choose(0.3, 100, None, 3) == other  # its engine has `limit` outstanding: saturated, it moves
    assert (counts.sticky, counts.saturated, counts.moved) == (1, 1, 1)
    assert disp.outstanding[first] == 2 and disp.outstanding[other] == 2  # pinned choices booked as the profile's
