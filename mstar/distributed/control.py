"""Rank 0's messages to the followers: each step's plan, heartbeats, stop. One ordered channel.

Rank 0 alone schedules. Before it runs a step it broadcasts the step's whole declaration to the
followers (`broadcast_object_list` on a gloo group of its own, apart from the model's collectives):

- the `BatchPlan` (token ids, row offsets, page tables and slot mapping, KDA slots, sampled rows,
  verify rows): what to feed and where each row's cache and state live;
- each row's pending KDA prefix length (the verify-accepted rows of the last step, which rank 0's
  commit recorded and the forward replays first);
- the KDA slot copies rank 0's pool made since the last step (prefix-cache snapshots taken at commit,
  and the snapshots new requests resume from), which a follower makes first, in the same order.

A follower holds no request state of its own: no scheduler, no sampler, no token counts. It runs
`ModelRunner.forward` on exactly these steps, so every rank takes the same control flow by
construction. Tokens that rank 0 samples or verifies reach the followers as input ids of the next
step, and what rank 0 committed (accepted lengths) as the prefix lengths of the next step: every
decision is rank 0's and every rank acts on it. A KDA slot is reset where a row starts a sequence
(num_computed == 0), which is exactly when rank 0's pool hands the slot out and zeroes it; a row that
starts after a cached prefix finds its slot filled by one of the copies instead.

Step ids count up by one; a follower that sees a gap stops (the ranks would no longer agree).

Heartbeats: when rank 0 has sent nothing for `interval` seconds and runs no step, it sends one, so a
follower blocked in `receive` hears from rank 0 at least every second while all is well. The
channel's gloo group has a timeout; a follower that hears nothing for that long (rank 0 hung), or
whose receive fails because rank 0's process is gone, stops.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from mstar.models.kimi_k3.serving import BatchPlan

STEP, HEARTBEAT, STOP, GEOMETRY = "step", "heartbeat", "stop", "geometry"


@dataclass(frozen=True)
class StepMessage:
    kind: str
    step_id: int = 0
    plan: BatchPlan | None = None  # CPU tensors
    prefix_lens: tuple[int, ...] = ()  # per row: its slot's pending KDA prefix length
    tap_layers: tuple[int, ...] = ()
    slot_copies: tuple[tuple[int, int], ...] = ()  # KDA (from slot, to slot) copies to make before the forward
    geometry: dict[str, Any] | None = None  # GEOMETRY: rank 0's pool shapes, checked by every follower


def plan_on(plan: BatchPlan, device: torch.device | str) -> BatchPlan:
    """The plan with its tensors on `device` (a no-op where they already are)."""
    return replace(
        plan,
        input_ids=plan.input_ids.to(device),
        kv=replace(plan.kv, page_table=plan.kv.page_table.to(device), slot_mapping=plan.kv.slot_mapping.to(device),
                   context_lens=plan.kv.context_lens.to(device)),
        kda_slots=plan.kda_slots.to(device),
        sample_rows=plan.sample_rows.to(device),
    )


class ControlChannel:
    """Messages from rank 0 to every other rank, in one order (a lock serialises rank 0's senders)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.rank = dist.get_rank(group)
        self._lock = threading.Lock()
        self._busy = False
        self._last_sent = time.monotonic()
        self._next_step = 0

    # --- rank 0 -------------------------------------------------------------------------------------
    def _send(self, message: StepMessage) -> None:
        dist.broadcast_object_list([message], src=0, group=self.group)
        self._last_sent = time.monotonic()

    def send(self, message: StepMessage) -> None:
        with self._lock:
            self._send(message)

    def send_step(self, plan: BatchPlan, prefix_lens: tuple[int, ...], tap_layers: tuple[int, ...],
                  slot_copies: tuple[tuple[int, int], ...] = ()) -> None:
        """Send one step; the channel counts as busy (no heartbeats) until `step_done`."""
        with self._lock:
            message = StepMessage(STEP, self._next_step, plan_on(plan, "cpu"), prefix_lens, tap_layers, slot_copies)
            self._busy = True
            self._send(message)
            self._next_step += 1

    def step_done(self) -> None:
        self._busy = False
        self._last_sent = time.monotonic()

    def heartbeat_if_idle(self, interval: float) -> None:
        with self._lock:
            if not self._busy and time.monotonic() - self._last_sent >= interval:
                self._send(StepMessage(HEARTBEAT))

    # --- followers ------------------------------------------------------------------------------------
    def receive(self) -> StepMessage:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        message = box[0]
        if not isinstance(message, StepMessage):
            raise RuntimeError(f"rank {self.rank}: the control channel delivered {type(message).__name__}, "
                               "not a StepMessage")
        return message


class Heartbeat:
    """Rank 0's thread that keeps the followers hearing from it while the engine is idle."""

    def __init__(self, channel: ControlChannel, interval: float, on_error):
        self.channel = channel
        self.interval = interval
        self.on_error = on_error
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mstar-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=self.interval + 5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval / 4):
            try:
                self.channel.heartbeat_if_idle(self.interval)
            except Exception as e:  # a follower is gone or hung
                if not self._stop.is_set():
                    self.on_error(f"a heartbeat to the followers failed: {type(e).__name__}: {e}")
                return
