"""A gymnasium environment over the simulator: one step = one placement choice.

The simulator asks a policy for a whole Decision at each event. Inside a decision
the ``rl`` policy (slurm_mig/policies/rl.py) walks the queue in priority order and,
for each job that can start now on more than one place, lists the candidate
placements with one feature row each. The environment pauses there (the
simulation runs in a worker thread that waits for the action): the observation
is the candidate table, the action is the index of the chosen candidate (invalid
indices are masked out), and the decision continues. When the decision is
complete it is applied and the simulator advances to the next event.

Observation (``gymnasium.spaces.Dict``):
    ``features``: float32 [max_candidates, N_FEATURES], rows past ``n`` are zero;
    ``mask``: int8 [max_candidates], 1 for real candidates.
``action_masks()`` returns the mask as booleans (sb3-contrib's MaskablePPO convention).

Reward: minus the waiting time the queue accrues, in hours, normalised by the
number of GPUs: after a decision at time t0 leaves n jobs pending until the next
decision at t1, that costs n x (t1 - t0); a job assigned to instances still being
created waits until they exist (its delay is charged at once). Undiscounted, the
episode's return is minus the total wait of its jobs (per GPU, in hours), the
quantity the benchmarks report as mean wait x jobs.

``info`` carries ``t`` (simulated time of the choice) and ``n`` (candidates), so a
trainer can build time-aligned baselines across rollouts of the same episode.
"""

from __future__ import annotations

import queue
import random
import threading
from typing import Callable

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from slurm_mig.policies.rl import N_FEATURES, Choice, RLPolicy
from slurm_mig.sim.engine import SimConfig, Simulator

from training.splits import Case, train_case


class _Abort(Exception):
    """Unwinds a decision in progress when the environment is reset or closed."""


_ABORT = object()


class _Episode:
    """Runs the simulator with the rl policy in a worker thread that pauses at each choice.

    The policy's ``chooser`` hands the Choice to the environment and blocks until the
    action comes back; the two threads never run at the same time (strict hand-off),
    so nothing is shared while it runs. The heuristics' own dispatch loop drives the
    decisions: the environment needs no copy of it.
    """

    def __init__(self, case: Case, K: int, policy_options: dict) -> None:
        self.actions: queue.Queue = queue.Queue()
        self.events: queue.Queue = queue.Queue()
        self.policy = RLPolicy(max_candidates=K, chooser=self._ask, explain_waiting=False, **policy_options)
        self.sim = Simulator(case.workload, self.policy, case.spec, SimConfig(explain=False))
        self.cost = 0.0  # job-seconds of waiting since the last hand-off
        self.thread = threading.Thread(target=self._run, name="mig-env", daemon=True)
        self.thread.start()

    def _ask(self, choice: Choice) -> int:
        cost, self.cost = self.cost, 0.0
        self.events.put(("choice", choice, cost))
        a = self.actions.get()
        if a is _ABORT:
            raise _Abort()
        return a

    def _run(self) -> None:
        try:
            sim = self.sim
            state = sim.reset()
            while state is not None:
                decision = self.policy.decide(state)
                t0 = state.now
                n_left = len(state.pending) - len(decision.assignments)
                state = sim.step(decision)
                self.cost += sum(max(0.0, sim.records[a.job_id].start - t0) for a in decision.assignments)
                if state is not None:
                    self.cost += n_left * (sim.now - t0)
            self.events.put(("done", None, self.cost))
        except _Abort:
            return
        except BaseException as exc:  # surface errors in the caller's thread
            self.events.put(("error", exc, 0.0))

    def next(self, action: int | None):
        if action is not None:
            self.actions.put(action)
        kind, payload, cost = self.events.get()
        if kind == "error":
            raise payload
        return kind, payload, cost

    def close(self) -> None:
        if self.thread.is_alive():
            self.actions.put(_ABORT)
            self.thread.join(timeout=5)


class MigPlacementEnv(gym.Env):
    """Placement choices of the ``rl`` policy on simulated workloads (see module doc)."""

    metadata = {"render_modes": []}

    def __init__(self, cases: Callable[[random.Random], Case] | list[Case] | None = None, *,
                 max_candidates: int = 32, policy_options: dict | None = None) -> None:
        super().__init__()
        self.cases = cases if cases is not None else train_case
        self.K = max_candidates
        self.policy_options = dict(policy_options or {})
        self.observation_space = spaces.Dict({
            "features": spaces.Box(-np.inf, np.inf, (self.K, N_FEATURES), np.float32),
            "mask": spaces.Box(0, 1, (self.K,), np.int8),
        })
        self.action_space = spaces.Discrete(self.K)
        self._rng = random.Random(0)
        self.case: Case | None = None
        self._ep: _Episode | None = None
        self._choice: Choice | None = None
        self._scale = 1.0

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        if seed is not None:
            self._rng = random.Random(seed)
        given = (options or {}).get("case")
        for _ in range(20):
            case = given
            if case is None:
                case = self.cases(self._rng) if callable(self.cases) else self._rng.choice(self.cases)
            self.close()
            self.case = case
            self._scale = 3600.0 * case.spec.gpus
            self._ep = _Episode(case, self.K, self.policy_options)
            kind, payload, cost = self._ep.next(None)
            if kind == "choice":
                self._choice = payload
                # Waiting before the first choice is no choice's doing; reported, not rewarded.
                return self._obs(), {**self._info(), "cost_before_s": cost}
            if given is not None:
                break
        # No choice to make in this workload (everything had one place to go).
        self._choice = None
        return self._empty_obs(), {"t": 0.0, "n": 0, "done": True}

    def step(self, action):
        if self._choice is None:
            raise RuntimeError("the episode is over: call reset()")
        n = len(self._choice.options)
        a = int(action)
        if not 0 <= a < n:
            raise ValueError(f"action {a} is masked: only {n} candidates")
        kind, payload, cost = self._ep.next(a)
        reward = -cost / self._scale
        if kind == "done":
            self._choice = None
            return self._empty_obs(), reward, True, False, {"t": self._ep.sim.now, "n": 0, "sim": self._ep.sim}
        self._choice = payload
        return self._obs(), reward, False, False, self._info()

    def close(self) -> None:
        if self._ep is not None:
            self._ep.close()
            self._ep = None

    def action_masks(self) -> np.ndarray:
        m = np.zeros(self.K, dtype=bool)
        if self._choice is not None:
            m[: len(self._choice.options)] = True
        return m

    def _obs(self) -> dict:
        f = np.zeros((self.K, N_FEATURES), dtype=np.float32)
        rows = self._choice.features
        f[: len(rows)] = rows
        m = np.zeros(self.K, dtype=np.int8)
        m[: len(rows)] = 1
        return {"features": f, "mask": m}

    def _empty_obs(self) -> dict:
        return {"features": np.zeros((self.K, N_FEATURES), dtype=np.float32), "mask": np.zeros(self.K, np.int8)}

    def _info(self) -> dict:
        return {"t": self._choice.state_now, "n": len(self._choice.options)}

    def candidate_features(self) -> np.ndarray:
        """The current choice's features without padding: [n, N_FEATURES]."""
        return np.asarray(self._choice.features, dtype=np.float32)
