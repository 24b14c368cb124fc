"""Fault injection, for tests only: make the engine fail the way real hardware and bugs do, on
purpose, and see that no request hangs, is lost or gets garbage.

Off unless asked for: `mstar-serve` injects what `MSTAR_FAULT_INJECT` says only when it is set (read
with the other environment knobs, `mstar.config.Environment`; a warning says faults are on); tests
build a `FaultInjector` and hand it to `AsyncEngine(faults=...)`.
The spec is a comma-separated list of entries:

  step:N      the engine's N-th step (1-based, counting steps that run the model) raises inside the
              step, after admission and the forward pass, before commit; repeatable (step:3,step:9)
  step:N+     every step from the N-th on raises (a persistent fault)
  crash:N     the engine thread itself raises before its N-th step attempt, outside the step's
              error handling (a bug in the loop)
  nan:MARKER  the logits of every request whose prompt text contains MARKER are NaN (inf:MARKER: +inf)

Tests may also `arm` an injector while the engine runs (fail the next step, crash the thread now).

What the engine does about each (see AsyncEngine and README, "Operating the server"): a failed step
ends every request in flight with an error and the engine goes on; `server.max_step_failures`
failed steps in a row, or a crashed engine thread, stop the engine: requests in flight and new ones
get errors, /health turns 503, and mstar-serve exits with status 3. Non-finite logits end only the
affected request, with an error (EngineCore checks every sampled row).

mstar-serve runs tp_size 1 only so far: killing a tensor-parallel rank belongs to the tensor-parallel
work (mstar/distributed), once mstar-serve runs it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from mstar.runner.executor import ModelStep, StepExecutor, StepOutput


class InjectedFault(RuntimeError):
    """The failure a fault injection raises."""


class FaultSpecError(ValueError):
    """A fault spec that cannot be parsed; the message names the entry."""


@dataclass(frozen=True)
class FaultPlan:
    failing_steps: frozenset[int] = frozenset()  # steps (1-based) that raise
    failing_from: int | None = None  # every step from this one on raises
    crash_at: int | None = None  # step attempt before which the engine thread raises
    poison: tuple[tuple[str, float], ...] = ()  # (prompt marker, value written into its logits)


def parse_fault_spec(text: str) -> FaultPlan:
    steps: set[int] = set()
    failing_from = crash_at = None
    poison: list[tuple[str, float]] = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        kind, sep, arg = entry.partition(":")
        if not sep or not arg:
            raise FaultSpecError(f"fault entry {entry!r} must look like step:N, step:N+, crash:N, nan:MARKER or "
                                 f"inf:MARKER")
        if kind in ("nan", "inf"):
            poison.append((arg, float(kind)))
            continue
        persistent = kind == "step" and arg.endswith("+")
        number = arg[:-1] if persistent else arg
        if kind not in ("step", "crash") or not number.isdigit() or int(number) < 1:
            raise FaultSpecError(f"fault entry {entry!r}: expected step:N, step:N+ or crash:N with N >= 1")
        if kind == "crash":
            crash_at = int(number)
        elif persistent:
            failing_from = int(number)
        else:
            steps.add(int(number))
    return FaultPlan(frozenset(steps), failing_from, crash_at, tuple(poison))


@dataclass
class FaultInjector:
    """Wraps an `EngineCore`'s step executor (`install`) to carry out a `FaultPlan`; `injected` counts
    what it did."""

    plan: FaultPlan
    steps: int = 0  # steps that reached the forward pass
    attempts: int = 0  # step attempts of the engine loop
    injected: Counter = field(default_factory=Counter)  # "step", "crash", "poisoned_rows"
    _prompt_text: dict[str, str] = field(default_factory=dict)
    _armed_step_failures: int = 0
    _armed_crash: bool = False

    @classmethod
    def from_spec(cls, text: str) -> FaultInjector:
        return cls(parse_fault_spec(text))

    def arm(self, *, step_failures: int = 0, crash: bool = False) -> None:
        """From a test, while the engine runs: fail the next `step_failures` steps that run the
        model, and/or crash the engine thread before its next step attempt."""
        self._armed_step_failures += step_failures
        self._armed_crash = self._armed_crash or crash

    def _step_fails(self) -> bool:
        if self._armed_step_failures > 0:
            self._armed_step_failures -= 1
            return True
        plan = self.plan
        return self.steps in plan.failing_steps or (plan.failing_from is not None and self.steps >= plan.failing_from)

    def install(self, core) -> None:
        """Wrap the engine's step executor: every step the engine runs passes through `FaultyExecutor`."""
        core.executor = FaultyExecutor(core.executor, self, core)

    def after_forward(self, core, step: ModelStep, output: StepOutput) -> StepOutput:
        """Count a step that ran the model; raise where the plan fails it, else poison its marked rows."""
        self.steps += 1
        if self._step_fails():
            self.injected["step"] += 1
            raise InjectedFault(f"injected fault in engine step {self.steps}")
        if self.plan.poison:
            return StepOutput(self._poisoned(core, step, output.logits), output.taps)
        return output

    def before_step(self) -> None:
        """Called by the engine loop before each step attempt, outside its error handling."""
        self.attempts += 1
        if self._armed_crash or (self.plan.crash_at is not None and self.attempts == self.plan.crash_at):
            self._armed_crash = False
            self.injected["crash"] += 1
            raise InjectedFault(f"injected crash of the engine thread before step attempt {self.attempts}")

    def _poisoned(self, core, step: ModelStep, logits: torch.Tensor) -> torch.Tensor:
        """The sampled rows of marked requests set to the poison value (rows as EngineCore reads them)."""
        live = set(core.requests)
        for request_id in [r for r in self._prompt_text if r not in live]:
            del self._prompt_text[request_id]
        logits = logits.clone()
        row = 0
        for s in step.decl.seqs:
            n = s.num_tokens if s.verify else int(s.sample)
            value = self._poison_value(core, s.request_id) if n else None
            if value is not None:
                logits[row : row + n] = value
                self.injected["poisoned_rows"] += n
            row += n
        return logits

    def _poison_value(self, core, request_id: str) -> float | None:
        text = self._prompt_text.get(request_id)
        if text is None:
            text = self._prompt_text[request_id] = core.tokenizer.decode(core.requests[request_id].prompt_ids)
        return next((value for marker, value in self.plan.poison if marker in text), None)


class FaultyExecutor:
    """A step executor that runs each step through `inner`, then lets the injector fail or poison it."""

    def __init__(self, inner: StepExecutor, injector: FaultInjector, core):
        self.inner, self.injector, self.core = inner, injector, core

    def execute(self, step: ModelStep) -> StepOutput:
        return self.injector.after_forward(self.core, step, self.inner.execute(step))
