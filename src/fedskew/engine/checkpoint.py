"""What a simulation must carry from one round to the next, so that a resumed run continues exactly.

Everything random is keyed by (seed, round, client) (``fedskew/seeding.py``), so a round depends only on this state and
on the round number: the global model, the models the server sent to clients (personalized methods), the models
clients hold after training, every client's persistent state (control variates, MOON's previous model, Ditto's and
FedAMP's own models, local head / BN groups), the server strategy's state (HEAL, FedCAC, FedAMP, FedAvgM, ...) and
the client part's server half's (SCAFFOLD's global control variate). The reusable training module itself carries
no state between rounds: every client loads what it received.

The three per-client maps (``personal``, ``trained``, ``client_states``) come from the simulation's client-state
store (``engine/state_store.py``): in RAM the checkpoint holds the dicts; on disk it holds a
:class:`~fedskew.engine.state_store.StoreRef` per map (the store's id and directory, each client's layout and slot),
the tensors stay in the store's files, and capturing pins the slots it references (only the latest capture of a
store stays valid).
"""

from __future__ import annotations

from typing import Any

from fedskew.engine.loop import Simulation
from fedskew.engine.state_store import MAPS

# the round server's (engine/round_server.py) and the per-client maps of the simulation's store (personal among them)
SERVER_ATTRS = ("global_params", "server_state", "server_half_state")
STATE_ATTRS = ("global_params", "personal", "trained", "client_states", "server_state", "server_half_state")
# 2: typed server state (AggregationState, ...) and the client part's server half's (before: client_server_state)
FORMAT = 2


def capture(sim: Simulation) -> dict[str, Any]:
    """The simulation's state after its last finished round (shared, not copied: save it before the next round)."""
    state = {name: getattr(sim.server, name) for name in SERVER_ATTRS}
    bound = {"client_states": sim.client_states, "personal": sim.server.personal, "trained": sim.trained}
    state.update(sim.state_store.capture({name: bound[name] for name in MAPS}))
    return {"format": FORMAT, **{name: state[name] for name in STATE_ATTRS}}


def restore(sim: Simulation, state: dict[str, Any]) -> None:
    """Put a captured state back into a simulation built from the same configuration."""
    if state.get("format") != FORMAT:
        raise ValueError(
            f"its checkpoint is of format {state.get('format')!r} (another fedskew version), this fedskew reads "
            f"format {FORMAT}: it cannot be resumed; start it over (fedskew run --overwrite; in a sweep, delete the "
            "run's checkpoint.pt and the sweep starts that run over; the numbers are the same)"
        )
    missing = [name for name in STATE_ATTRS if name not in state]
    if missing:
        raise ValueError(f"checkpoint lacks {', '.join(missing)}")
    template = sim.server.global_params
    if set(state["global_params"]) != set(template) or any(
        state["global_params"][k].shape != v.shape for k, v in template.items()
    ):
        raise ValueError("the checkpoint's model does not match this configuration's model")
    for name in SERVER_ATTRS:
        setattr(sim.server, name, state[name])
    sim.bind_states(sim.state_store.restore({name: state[name] for name in MAPS}))
