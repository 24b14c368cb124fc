"""Rank workers: one process per tensor-parallel rank, in lockstep, and what happens when one dies.

    mstar-serve (rank 0)                         followers (ranks 1 .. tp-1), spawned by rank 0
    ---------------------------------            ---------------------------------------------
    HTTP server, AsyncEngine thread              ignore SIGINT/SIGTERM (rank 0 decides when to stop)
    EngineCore: scheduler, sampler, a runner     a ModelRunner of its own (the same pools, kernels
                                                 and graphs); no scheduler, no requests
    each step: send the plan (control.py) ---->  receive the plan
               ModelRunner.forward  <-- model collectives (Communicator) -->  ModelRunner.forward
               sample, commit, stream            (nothing else: no request state)

Speculative decoding (DSpark) runs on rank 0 alone, around the shared step: rank 0 drafts before
it sends the step, then verifies the step's logits and writes the draft's context from the taps
(the residual stream, complete on every rank after each all-reduce, so rank 0's are the whole
model's). To the followers a verify step is an ordinary step: the plan marks its verify rows, which
feed [anchor, drafts] and keep their KDA block pending, and the next step's prefix lengths say how
many of those rows rank 0 accepted. Followers hold no draft, but their pools are sized for verify
blocks of k + 1 rows as rank 0's are (`follower_speculative`; the geometry check covers it).

Several nodes (rendezvous.py): rank 0 is node 0's local rank 0 and spawns only node 0's followers; the
store listens on the master address and port, and holds the pickled RankSetup (SETUP_KEY), which the
launcher of each other node reads (launch.py) to spawn that node's ranks with `follower_main`.

Startup: rank 0 opens a TCPStore, spawns the followers, and every rank joins three groups: the
default gloo group (startup barrier), a gloo control group (step messages, control.py) and the data
group the model's `Communicator` runs on (gloo on CPU, NCCL + symmetric memory on GPU, chosen in
comm_choice.py). Each rank loads only its slices of the checkpoint (loader.py) and builds its pools;
after a barrier rank 0 sends its pool geometry, which every follower must match.

Failure, all within seconds, never a hang:
- a follower process exits unexpectedly (crash, OOM kill, SIGKILL): rank 0's monitor thread sees it
  (process sentinels, polled every 0.25 s), logs which rank and its exit status, kills the other
  followers (so a collective in flight fails at once and the requests in it end with an error),
  and after a short grace ends rank 0 with status EXIT_RANK_FAILED (3);
- rank 0 disappears: a follower's receive fails (the control connection closes) or times out (no
  heartbeat within `control_s`), or its watchdog sees it was re-parented; it exits with status 1;
- a follower's step raises: it logs the error and exits 1, and rank 0 proceeds as above;
- another node: rank 0 cannot see its processes. Their death breaks the next collective or heartbeat
  (a closed connection), and a node that goes silent stops its beat in the store (node_beats.py): either
  way rank 0 fails as above within `node_silence_s` + `failure_grace_s`. The other node's launcher sees
  its own ranks die, or node 0's beat stop, and kills the rest of its ranks (launch.py).
SIGTERM / Ctrl-C go to rank 0, which drains (open requests finish), then sends STOP, waits for the
followers to exit and kills any that do not. At exit rank 0 kills whatever follower is still alive,
so no rank outlives it.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing.connection
import os
import pickle
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mstar.checkpoint.safetensors_io import CheckpointReader
from mstar.config import NO_ENV, EngineConfig, Environment, ServeConfig, torch_dtype
from mstar.engine.async_engine import AsyncEngine
from mstar.engine.core import EngineCore, SpeculativeModels, build_runner
from mstar.models.kimi_k3.config import load_config
from mstar.models.kimi_k3.model import KimiK3ForCausalLM
from mstar.models.kimi_k3.serving import BatchPlan
from mstar.models.kimi_k3.tokenizer import KimiTokenizer
from mstar.process_name import set_process_name
from mstar.resources.latent_kv import PagedLatentKV
from mstar.resources.recurrent_pool import RecurrentStatePool
from mstar.runner.executor import ModelStep, StepExecutor, StepOutput
from mstar.runner.model_runner import ModelRunner
from mstar.speculative.proposer import VocabHeads

from .comm_choice import CommConfig, build_communicator
from .communicator import Communicator
from .control import GEOMETRY, HEARTBEAT, STEP, STOP, ControlChannel, Heartbeat, StepMessage, plan_on
from .loader import load_rank_model, load_vocab_heads
from .node_beats import NodeBeats, alive_key, stopped_key
from .rendezvous import Rendezvous, RendezvousError
from .sharding import ShardingPlan

log = logging.getLogger("mstar.distributed")

EXIT_RANK_FAILED = 3  # rank 0's exit status when a rank died (as mstar-serve's when its engine stops for good)
FAILURE_ATTRIBUTION_S = 1.0  # how long a failed step waits for the monitor to name the rank that died
RANK_NAME = "mstar-rank"  # a follower's process name is this and its rank (ps and top show it)
SETUP_KEY = "mstar/setup"  # the pickled RankSetup, in the store, for the launchers of the other nodes


@dataclass(frozen=True)
class Timeouts:
    startup_s: float = 1800.0  # rendezvous, then every rank loading its slices (large checkpoints take minutes)
    control_s: float = 30.0  # a follower that hears nothing from rank 0 this long stops
    heartbeat_s: float = 1.0  # rank 0 sends a heartbeat after this long without a message
    collective_s: float = 600.0  # one model collective (ranks wait for the slowest)
    stop_s: float = 10.0  # followers' exit after STOP, before they are killed
    node_silence_s: float = 5.0  # several nodes: a node whose beat (node_beats.py) stops this long is gone
    failure_grace_s: float = 1.0  # after a rank died: time for failed requests to reach their clients


@dataclass(frozen=True)
class RankSetup:
    """What every rank needs to build its part: sent to each follower of node 0 when it is spawned, and
    through the store to the launchers of the other nodes. It holds no secret (`follower_setup`)."""

    checkpoint: str
    tp_size: int
    ep_size: int
    dtype: torch.dtype
    device_type: str  # "cpu" or "cuda"
    engine: EngineConfig  # rank 0's, without the server's settings (its API keys)
    comm: CommConfig
    store_host: str  # node 0's address (the master's), where the TCPStore listens
    store_port: int
    nproc_per_node: int  # ranks on each node: global rank r runs on node r // nproc_per_node
    timeouts: Timeouts = field(default_factory=Timeouts)
    log_level: int = logging.INFO
    latent_sharded: bool = False  # the latent MoE's projections split over the ranks (ShardingPlan)
    speculative: SpeculativeModels | None = None  # the followers' (`follower_speculative`)
    env: Environment = NO_ENV  # rank 0's environment knobs, without its API keys (followers read none of their own)

    def plan(self, rank: int) -> ShardingPlan:
        return ShardingPlan(self.tp_size, rank, self.ep_size, self.latent_sharded)

    @property
    def nnodes(self) -> int:
        return self.tp_size // self.nproc_per_node

    def device(self, rank: int) -> torch.device:
        """The rank's GPU on its node: its local rank (wrapping where the node has fewer GPUs, for tests)."""
        if self.device_type == "cuda":
            return torch.device("cuda", rank % self.nproc_per_node % torch.cuda.device_count())
        return torch.device("cpu")


def follower_setup(engine: EngineConfig, env: Environment, **fields: Any) -> RankSetup:
    """The RankSetup rank 0 sends: its engine config without the `server` section and its environment
    without the API keys. Followers serve no HTTP, and the setup crosses the network to other nodes."""
    engine_only = EngineConfig.model_construct(**{name: getattr(engine, name) for name in EngineConfig.model_fields})
    return RankSetup(engine=engine_only, env=env.model_copy(update={"api_keys": ()}), **fields)


@dataclass
class RankRuntime:
    """One rank's groups and model communicator."""

    store: dist.Store
    control: ControlChannel
    comm: Communicator


def _join(setup: RankSetup, rank: int, store: dist.Store) -> RankRuntime:
    t = setup.timeouts
    device = setup.device(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=setup.tp_size,
                            timeout=timedelta(seconds=t.startup_s))
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=t.control_s))
    nccl = device.type == "cuda" and setup.comm.protocol != "GLOO"
    data = dist.new_group(backend="nccl" if nccl else "gloo", timeout=timedelta(seconds=t.collective_s))
    comm = build_communicator(data, device, setup.comm, setup.dtype)
    return RankRuntime(store, ControlChannel(control), comm)


def _load(setup: RankSetup, rank: int, comm: Communicator) -> KimiK3ForCausalLM:
    return load_rank_model(setup.checkpoint, setup.plan(rank), comm, dtype=setup.dtype, device=setup.device(rank))


def check_tp_checkpoint(checkpoint: str | Path, tp_size: int, ep_size: int, latent_sharded: bool = False) -> None:
    """Raise (naming the key) unless the checkpoint shards over tp_size ranks in ep_size expert groups
    (MXFP4 experts: on whole scale groups). Reads the config and the tensor names only."""
    plan = ShardingPlan(tp_size, 0, ep_size, latent_sharded)
    config = load_config(checkpoint)
    plan.check(config)
    with CheckpointReader(checkpoint) as reader:
        if any(name.endswith(".weight_packed") for name in reader.names()):
            plan.expert_sharding(config).check_mxfp4()


# --- pools and their geometry ------------------------------------------------------------------------


def follower_runner(model: KimiK3ForCausalLM, engine: EngineConfig, speculative: SpeculativeModels | None = None, *,
                    env: Environment = NO_ENV) -> ModelRunner:
    """A follower's runner: pools, kernels and graphs exactly as rank 0's EngineCore builds them
    (`build_runner`), so rank 0's plans address the same slots and pages. The pools are also checked
    against rank 0's geometry at startup."""
    return build_runner(model, engine, speculative, env=env)


def follower_speculative(spec: SpeculativeModels | None) -> SpeculativeModels | None:
    """A follower's view of rank 0's speculation: no draft and no heads. A follower never drafts (and
    is not sent the draft's weights), but it runs rank 0's verify blocks, so its KDA pool keeps pending
    prefixes of k + 1 rows, as rank 0's does, and it computes the draft's taps in its steps, so its
    decode graphs are captured with them (else it would replay none)."""
    if spec is None:
        return None
    return replace(spec, draft=None, heads=None, tap_layers=spec.taps())


def rank0_speculative(spec: SpeculativeModels | None, setup: RankSetup) -> SpeculativeModels | None:
    """Rank 0's speculation: the draft gets whole-vocabulary heads of its own.

    The rank's embedding and lm_head are vocabulary slices whose forward is a collective; the draft
    runs on rank 0 alone, between steps, so it cannot use them (a gather per draft step would make
    every follower take part in drafting). Rank 0 instead reads the whole embed_tokens and lm_head
    from the checkpoint once. Cost, on rank 0 only: 2 x vocab x hidden x dtype bytes; for pruned75
    (163,840 x 7,168, bf16) 2 x 2.19 GiB = 4.4 GiB beside its 1/8 slices. Followers pay nothing."""
    if spec is None:
        return None
    embed, lm_head = load_vocab_heads(setup.checkpoint, dtype=setup.dtype, device=setup.device(0))
    return replace(spec, heads=VocabHeads(embed, lm_head))


def pool_geometry(kv: PagedLatentKV, pool: RecurrentStatePool) -> dict[str, Any]:
    return {name: (tuple(t.shape), str(t.dtype)) for name, t in
            (("latent_kv", kv.cache), ("kda_state", pool.state), ("kda_conv", pool.conv),
             ("kda_prefix", pool.prefix_x))}


# --- followers ------------------------------------------------------------------------------------------


def apply_step(runner: ModelRunner, message: StepMessage, device: torch.device) -> None:
    """Run rank 0's step here: make rank 0's KDA slot copies, reset the slots of rows that start a sequence,
    take the pending prefix lengths, then the forward (its logits are rank 0's business)."""
    plan: BatchPlan = plan_on(message.plan, device)
    pool = runner.pool
    pool.apply_copies(message.slot_copies)
    for b, slot in enumerate(plan.host_slots()):
        if plan.num_computed[b] == 0:
            pool.state[:, slot].zero_()
            pool.conv[:, slot].zero_()
        pool.prefix_len[slot] = message.prefix_lens[b]
    runner.forward(plan, message.tap_layers)


class LostRankZero(RuntimeError):
    """A follower no longer hears from rank 0."""


def follow(channel: ControlChannel, runner: ModelRunner, device: torch.device) -> None:
    """Run rank 0's steps until it says STOP."""
    rank = channel.rank
    expected_step = 0
    geometry = pool_geometry(runner.kv, runner.pool)
    while True:
        try:
            message = channel.receive()
        except Exception as e:
            raise LostRankZero(f"rank {rank} lost rank 0 (its process is gone, or it sent nothing within the "
                               f"control timeout): {type(e).__name__}: {str(e).splitlines()[0]}") from e
        if message.kind == STOP:
            return
        if message.kind == HEARTBEAT:
            continue
        if message.kind == GEOMETRY:
            if message.geometry != geometry:
                raise RuntimeError(f"rank {rank}: its pools {geometry} differ from rank 0's {message.geometry}")
            continue
        if message.kind != STEP:
            raise RuntimeError(f"rank {rank}: unknown control message {message.kind!r}")
        if message.step_id != expected_step:
            raise RuntimeError(f"rank {rank}: received step {message.step_id}, expected {expected_step}: "
                               "the ranks are out of lockstep")
        apply_step(runner, message, device)
        expected_step += 1


def _watch_parent(parent_pid: int, rank: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            log.error("rank %d: rank 0 (pid %d) is gone; exiting", rank, parent_pid)
            os._exit(1)


def follower_main(setup: RankSetup, rank: int, parent_pid: int) -> None:
    """Entry point of a follower process."""
    set_process_name(f"{RANK_NAME}{rank}")
    # A group-wide Ctrl-C or SIGTERM must not kill a follower while rank 0 drains: rank 0 stops it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=setup.log_level, format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
    threading.Thread(target=_watch_parent, args=(parent_pid, rank), name="mstar-watch-rank0", daemon=True).start()
    try:
        store = dist.TCPStore(setup.store_host, setup.store_port, is_master=False,
                              timeout=timedelta(seconds=setup.timeouts.startup_s))
        runtime = _join(setup, rank, store)
        model = _load(setup, rank, runtime.comm)
        runner = follower_runner(model, setup.engine, setup.speculative, env=setup.env)
        dist.barrier()  # every rank has loaded
        log.info("rank %d ready (%s, pid %d)", rank, runtime.comm, os.getpid())
        follow(runtime.control, runner, setup.device(rank))
    except LostRankZero as e:
        log.error("%s; exiting", e)
        logging.shutdown()
        os._exit(1)
    except BaseException as e:
        log.error("rank %d stops: %s: %s\n%s", rank, type(e).__name__, e, traceback.format_exc())
        logging.shutdown()
        os._exit(1)  # no clean-up that could wait on a peer that is gone
    dist.destroy_process_group()
    log.info("rank %d stopped", rank)
    logging.shutdown()
    # Exit now: a spawned child would otherwise finalize the interpreter (a full garbage collection of
    # torch's and the model's objects), which took ~9 s on a loaded CPU, against rank 0's stop timeout.
    os._exit(0)


# --- rank 0 ----------------------------------------------------------------------------------------------


class Ranks:
    """Rank 0's handle on the followers: watches them, stops them, and fails everything when one dies.
    It watches node 0's followers by their processes and every other node by its beat (node_beats.py)."""

    def __init__(self, setup: RankSetup, processes: list[Any], *, exit_on_failure: bool,
                 store: dist.Store | None = None):
        self.setup = setup
        self.processes = processes  # index i: rank i + 1 (node 0's followers)
        self.exit_on_failure = exit_on_failure
        self.failed: str | None = None
        self.runtime: RankRuntime | None = None
        self.heartbeat: Heartbeat | None = None
        self.store = store
        self.beats: NodeBeats | None = None
        if setup.nnodes > 1:
            self.beats = NodeBeats(setup.store_host, setup.store_port, 0, range(1, setup.nnodes),
                                   interval_s=setup.timeouts.heartbeat_s, timeout_s=setup.timeouts.node_silence_s,
                                   on_lost=self.fail)
        self._stopping = False
        self._stopped = False
        self._listeners: list[Callable[[str], None]] = []
        self._fail_lock = threading.Lock()
        self._failed_event = threading.Event()
        self._monitor = threading.Thread(target=self._watch, name="mstar-rank-monitor", daemon=True)
        atexit.register(self.kill)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def on_failure(self, listener: Callable[[str], None]) -> None:
        """Call `listener(message)` (from the monitor thread) when a rank fails."""
        self._listeners.append(listener)

    def start_monitor(self) -> None:
        self._monitor.start()
        if self.beats is not None:
            self.beats.start()

    def wait_for_nodes(self, timeout: float) -> None:
        """Several nodes: wait up to `timeout` seconds until every other node's launcher has joined."""
        if self.beats is None:
            return
        deadline = time.monotonic() + timeout
        while True:
            # a node's counter, 0 until its first beat (reading it with add(0) creates it: check() would not do)
            missing = [n for n in range(1, self.setup.nnodes) if self.store.add(alive_key(n), 0) == 0]
            if not missing:
                return
            if time.monotonic() > deadline:
                raise RendezvousError(f"node(s) {', '.join(map(str, missing))} did not join within {timeout:g} s "
                                      "(--rendezvous-timeout): start `mstar-serve` with the same config and "
                                      "--node-rank N, --master-addr and --master-port on each of them")
            self.check()
            time.sleep(0.1)

    def wait_for_failure(self, timeout: float) -> bool:
        """True when a rank failure is known within `timeout` seconds."""
        return self._failed_event.wait(timeout)

    def check(self) -> None:
        if self.failed is not None:
            raise RuntimeError(f"tensor-parallel ranks failed: {self.failed}")

    def _watch(self) -> None:
        alive = {p.sentinel: rank for rank, p in enumerate(self.processes, start=1)}
        while alive and not self._stopping:
            for sentinel in multiprocessing.connection.wait(list(alive), timeout=0.25):
                rank = alive.pop(sentinel)
                if self._stopping:
                    return
                p = self.processes[rank - 1]
                p.join(1)  # its sentinel closes as it exits; reap it for the exit status
                # Several nodes: a follower here most often stops because a rank of another node died; that
                # node's report reaches the beats within a beat and names the cause (its `fail` wins).
                if self.beats is not None and self.wait_for_failure(FAILURE_ATTRIBUTION_S +
                                                                    self.setup.timeouts.heartbeat_s):
                    return
                self.fail(f"rank {rank} (pid {p.pid}) exited with status {p.exitcode}")
                return

    def heartbeat_failed(self, message: str) -> None:
        """A heartbeat broadcast broke: most often a follower died, which the monitor names shortly."""
        if not self.wait_for_failure(FAILURE_ATTRIBUTION_S):
            self.fail(message)

    def fail(self, message: str) -> None:
        """A rank is gone: stop every rank; end rank 0 when it serves (exit_on_failure)."""
        with self._fail_lock:
            if self.failed is not None or self._stopping:
                return
            self.failed = message
            self._failed_event.set()
        log.critical("%s; stopping all %d ranks", message, self.setup.tp_size)
        self.kill()
        for listener in self._listeners:
            try:
                listener(message)
            except Exception:
                log.exception("a rank-failure listener failed")
        if self.exit_on_failure:
            time.sleep(self.setup.timeouts.failure_grace_s)
            log.critical("exiting with status %d: %s", EXIT_RANK_FAILED, message)
            logging.shutdown()
            os._exit(EXIT_RANK_FAILED)

    def kill(self) -> None:
        """SIGKILL every follower still alive and reap it."""
        for p in self.processes:
            if p.is_alive():
                p.kill()
        for p in self.processes:
            p.join(5)

    def abandon(self) -> None:
        """Rank 0 itself failed (at startup): kill the followers without calling it their failure."""
        self._stopping = True
        self._stopped = True
        self._stop_watching()
        self.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        atexit.unregister(self.kill)

    def stop(self) -> None:
        """Orderly end: STOP to the followers, wait for them, kill stragglers, leave the groups."""
        if self._stopped:
            return
        self._stopped = True
        self._stopping = True
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if self.failed is None and self.runtime is not None:
            try:
                self.runtime.control.send(StepMessage(STOP))
            except Exception as e:
                log.warning("could not send STOP to the followers (%s); killing them", e)
        deadline = time.monotonic() + self.setup.timeouts.stop_s
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))
        stragglers = [p.pid for p in self.processes if p.is_alive()]
        if stragglers:
            log.warning("followers %s did not stop within %.0f s; killing them", stragglers, self.setup.timeouts.stop_s)
        self.kill()
        self._wait_for_remote_nodes(deadline)
        self._stop_watching()
        if dist.is_initialized():
            dist.destroy_process_group()
        atexit.unregister(self.kill)

    def _stop_watching(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if self.beats is not None:
            self.beats.stop()

    def _wait_for_remote_nodes(self, deadline: float) -> None:
        """Keep the store up until each other node's launcher says its ranks have stopped (else it would
        take the store's end for node 0's failure)."""
        if self.beats is None or self.failed is not None:
            return
        keys = [stopped_key(n) for n in range(1, self.setup.nnodes)]
        while not self.store.check(keys):
            if time.monotonic() > deadline:
                log.warning("not every node reported its ranks stopped within %.0f s", self.setup.timeouts.stop_s)
                return
            time.sleep(0.05)


class LeaderExecutor:
    """Rank 0's step executor: sends each step to the followers, then runs it here (through `inner`).

    With async scheduling (engine/core.py) a decode step's input ids are the tokens the step in flight
    samples, gathered on the device (and a verify step's positions shift by what the one in flight
    keeps); sending them to the followers copies them to the host, which waits for that step to end.
    The overlap left on rank 0 is its work on one step's outputs while the next runs; the followers
    replay what they receive, in order, either way."""

    def __init__(self, inner: StepExecutor, pool: RecurrentStatePool, ranks: Ranks, channel: ControlChannel):
        self.inner = inner
        self.pool = pool
        self.ranks = ranks
        self.channel = channel

    @torch.no_grad()
    def execute(self, step: ModelStep) -> StepOutput:
        self.ranks.check()
        # a plan made while a verify step runs shifts its rows by what that step keeps, on the device:
        # the followers get the settled lengths (reading them waits for the step, as the input ids do)
        prefix_lens = tuple(step.plan.settled_pending(self.pool))
        try:
            self.channel.send_step(step.plan.settled(), prefix_lens, tuple(step.tap_layers), step.slot_copies)
            return self.inner.execute(step)
        except Exception as e:
            # A broken collective is most often a rank that died: say which, once the monitor knows.
            if self.ranks.wait_for_failure(FAILURE_ATTRIBUTION_S):
                raise RuntimeError(f"a tensor-parallel rank failed: {self.ranks.failed}") from e
            raise
        finally:
            self.channel.step_done()


def start_ranks(checkpoint: str | Path, tokenizer: Any, engine_config: EngineConfig,
                speculative: SpeculativeModels | None = None, *, tp_size: int, ep_size: int = 1,
                dtype: torch.dtype = torch.float32, device_type: str = "cpu", env: Environment = NO_ENV,
                comm: CommConfig | None = None, timeouts: Timeouts | None = None,
                exit_on_failure: bool = False, latent_sharded: bool = False,
                rendezvous: Rendezvous | None = None) -> tuple[EngineCore, Ranks]:
    """Spawn node 0's followers, load rank 0's slices, and return rank 0's EngineCore (its forward drives
    every rank) with the handle on the ranks. `exit_on_failure`: a dead rank ends this process.
    With `speculative` (the draft, given when engine_config speculates), rank 0 drafts and every rank
    verifies. `latent_sharded`: the latent MoE's projections split over the ranks (sharding.py).
    `rendezvous` (default: every rank on this node): with several nodes, the store listens on the master
    port, the setup waits there for the other nodes' launchers (launch.py), and they start their ranks."""
    if tp_size < 2:
        raise ValueError(f"tp_size={tp_size}: rank workers are for tp_size >= 2")
    rdzv = rendezvous or Rendezvous("127.0.0.1", 0, 1, 0, tp_size)
    if rdzv.world_size != tp_size or rdzv.node_rank != 0:
        raise ValueError(f"rank 0 runs on node 0 of nnodes x nproc_per_node = tp_size ranks; got {rdzv} for "
                         f"tp_size={tp_size}")
    check_tp_checkpoint(checkpoint, tp_size, ep_size, latent_sharded)
    timeouts = timeouts or Timeouts()
    store = open_store(rdzv, timeouts.startup_s)
    setup = follower_setup(engine_config, env, checkpoint=str(checkpoint), tp_size=tp_size, ep_size=ep_size,
                           dtype=dtype, device_type=device_type, comm=comm or CommConfig(),
                           store_host=rdzv.master_addr, store_port=store.port, nproc_per_node=rdzv.nproc_per_node,
                           timeouts=timeouts, log_level=logging.getLogger().getEffectiveLevel(),
                           latent_sharded=latent_sharded, speculative=follower_speculative(speculative))
    if rdzv.multi_node:
        store.set(SETUP_KEY, pickle.dumps(setup))
    context = torch.multiprocessing.get_context("spawn")
    processes = [context.Process(target=follower_main, args=(setup, rank, os.getpid()), name=f"{RANK_NAME}{rank}")
                 for rank in range(1, rdzv.nproc_per_node)]
    for p in processes:
        p.start()
    ranks = Ranks(setup, processes, exit_on_failure=exit_on_failure, store=store)
    log.info("started %d follower ranks on this node (pids %s)%s", len(processes), ranks.pids,
             f"; waiting for nodes 1..{rdzv.nnodes - 1} at {rdzv.master_addr}:{store.port}" if rdzv.multi_node else "")
    ranks.start_monitor()
    try:
        ranks.wait_for_nodes(rdzv.timeout_s)
        runtime = ranks.runtime = _join(setup, 0, store)
        model = _load(setup, 0, runtime.comm)
        core = EngineCore(model, tokenizer, engine_config, rank0_speculative(speculative, setup), env=env)
        dist.barrier()  # every rank has loaded
        runtime.control.send(StepMessage(GEOMETRY, geometry=pool_geometry(core.kv, core.pool)))
        core.executor = LeaderExecutor(core.executor, core.pool, ranks, runtime.control)
        ranks.heartbeat = Heartbeat(runtime.control, setup.timeouts.heartbeat_s, ranks.heartbeat_failed).start()
    except BaseException as e:
        follower_failure = ranks.failed  # a follower's death explains the error better than a broken collective
        ranks.abandon()
        if follower_failure is not None:
            raise RuntimeError(f"tensor-parallel startup failed: {follower_failure}") from e
        raise
    log.info("%d ranks ready (tp_size=%d, ep_size=%d, %s)", tp_size, tp_size, ep_size, runtime.comm)
    return core, ranks


class TPEngine(AsyncEngine):
    """The AsyncEngine of rank 0 (same interface to the server); shutdown also stops the followers."""

    def __init__(self, core: EngineCore, model_name: str, ranks: Ranks, **engine_kwargs: Any):
        super().__init__(core, model_name, **engine_kwargs)
        self.ranks = ranks
        ranks.on_failure(self._rank_failed)

    def _rank_failed(self, message: str) -> None:
        self._accepting = False  # new requests are refused; the step in flight fails with the dead rank

    @property
    def healthy(self) -> bool:
        return super().healthy and self.ranks.failed is None

    def shutdown(self, timeout: float = 30.0) -> None:
        try:
            super().shutdown(timeout)
        finally:
            self.ranks.stop()


def open_store(rdzv: Rendezvous, timeout_s: float) -> dist.TCPStore:
    """Rank 0's TCPStore, where every rank meets: on the master port (0: a free one, one node only)."""
    try:
        return dist.TCPStore(rdzv.master_addr, rdzv.master_port, None, is_master=True, wait_for_workers=False,
                             timeout=timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise RendezvousError(f"cannot open the rendezvous store on port {rdzv.master_port} (--master-port): "
                              f"{str(e).splitlines()[0]}; choose another port, the same on every node") from None


def build_tp_engine(cfg: ServeConfig, speculative: SpeculativeModels | None, *, device: str,
                    env: Environment = NO_ENV, tensor_comm_protocol: str = "SHM", timeouts: Timeouts | None = None,
                    rendezvous: Rendezvous | None = None, **engine_kwargs: Any) -> TPEngine:
    """rank 0's engine for mstar-serve with `cfg.tp_size` ranks: spawns the followers, loads the slices,
    starts the engine thread. A rank that dies ends this process with status EXIT_RANK_FAILED;
    `engine.shutdown()` (after the server drained) stops every rank. With `cfg.speculative`,
    `speculative` carries the loaded draft (serve.py's `speculative_models`)."""
    if rendezvous is not None and rendezvous.multi_node and torch.device(device).type == "cuda" \
            and tensor_comm_protocol == "SHM":
        raise ValueError(f"--tensor-comm-protocol SHM (symmetric memory over NVLink) works inside one node; the "
                         f"ranks of {rendezvous.nnodes} nodes need --tensor-comm-protocol NCCL")
    tokenizer = KimiTokenizer.from_dir(cfg.checkpoint)
    latent_moe = load_config(cfg.checkpoint).routed_expert_hidden_size is not None  # Kimi-Linear has none
    core, ranks = start_ranks(cfg.checkpoint, tokenizer, cfg, speculative, tp_size=cfg.tp_size,
                              ep_size=cfg.model_kwargs.moe_ep_size, dtype=torch_dtype(cfg.dtype),
                              device_type=torch.device(device).type, env=env,
                              comm=CommConfig(protocol=tensor_comm_protocol), timeouts=timeouts,
                              exit_on_failure=True, rendezvous=rendezvous,
                              latent_sharded=latent_moe and cfg.model_kwargs.latent_moe_layout == "sharded")
    return TPEngine(core, cfg.served_model_name, ranks, **engine_kwargs).start()
