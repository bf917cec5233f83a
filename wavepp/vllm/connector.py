"""``WavePPConnector``: vLLM (CPU, 0.31 and 0.32) decoding a prompt whose cache WavePP's pipeline
computed, pulling each stage's band straight from that stage's band server
(``docs/handoff.md``, the connector). Loaded by an unmodified vLLM::

    --kv-transfer-config '{"kv_connector": "WavePPConnector",
                           "kv_connector_module_path": "wavepp.vllm",
                           "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute"}'

The scheduler's side reads a request's ``kv_transfer_params`` (WavePP's answer as a
P/D proxy copies it), claims the whole blocks of the prefix on which WavePP's
``prompt_token_ids`` agree with the decoder's own, and loads them asynchronously: the
request waits in vLLM's remote-KV state while the worker's side pulls every stage at
once, each band checked before any of it is written (``pulling``), and every layer's
keys and values written into the request's blocks as they arrive. Once every layer of
every stage has landed the request is reported received; a band refused, never arriving
or arriving wrong reports every block of the load as failed (vLLM then recomputes them,
or fails the request, per ``kv_load_failure_policy``). Malformed ``kv_transfer_params``
are such a load error too, never an exception in vLLM's loop.

This module imports vLLM; nothing else of WavePP imports it (``wavepp.vllm`` loads it
when vLLM asks for the class).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.logger import init_logger

try:  # vLLM 0.32 counts external cache hits by where they came from; 0.31 does not
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:
    CacheHitSource = None

from wavepp.handoff import auth, wire
from wavepp.handoff.gate import Gate
from wavepp.vllm import figures, plan
from wavepp.vllm.pulling import PullFailed, pull_band
from wavepp.vllm.stats import LoadMetrics, LoadStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = init_logger("vllm.wavepp_connector")  # under vLLM's logger: its handlers print it

# What this process's connectors did (the tests read them; one line each is logged too):
# loads, loaded tokens, failures by reason, refused params
COUNTS: collections.Counter[str] = collections.Counter()
LOADS: collections.deque[dict] = collections.deque(maxlen=4096)  # one per finished load


@dataclass
class LoadSpec:
    """One request's load, from the scheduler to the worker: tokens [start, end) of the
    prompt into ``block_ids`` (one per block of the range), from ``stages``."""

    req_id: str
    wavepp_id: str
    stages: tuple[str, ...]
    num_tokens: int  # T: the prompt WavePP computed
    start: int
    end: int
    block_ids: list[int]
    digest: str  # plan.token_digest of the decoder's prompt[:end]
    error: str = ""  # set: the load fails at once (malformed kv_transfer_params)
    release: bool = False  # nothing to load: refuse the bands, so the stages free them now
    arrival: float = 0.0  # the request's arrival at vLLM (its arrival_time: time.time())


@dataclass
class WavePPMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)


@dataclass
class _Plan:
    end: int  # whole-block prompt length loaded (tokens)
    source: plan.Source | None
    error: str = ""


@dataclass(eq=False)
class _Load:
    """A load under way on the worker."""

    spec: LoadSpec
    deadline: float
    started: float
    lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False  # reported: nothing is written any more
    futures: list = field(default_factory=list)
    socks: list = field(default_factory=list)
    layers: dict[int, float] = field(default_factory=dict)  # layer -> written (time.time())
    errors: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)  # figures.REASONS, one per error
    received_bytes: int = 0  # payload bytes of the bands accepted
    written_bytes: int = 0  # bytes written into the paged cache
    last_landed: float = 0.0  # time.monotonic() of the last layer written

    def fail(self, error: str, reason: str) -> None:
        """Under ``lock``."""
        self.errors.append(error)
        self.reasons.append(reason)


class WavePPConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's KV connector (``kv_consumer``) for prompts prefilled by WavePP."""

    if CacheHitSource is not None:  # vllm:prompt_tokens_cached_by_source{source="p2p"}
        _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:  # fmt: skip
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = self._kv_transfer_config
        self.settings = plan.read_settings(tc.kv_connector_extra_config, os.environ)
        if tc.kv_role not in ("kv_consumer", "kv_both"):
            raise ValueError(f"WavePPConnector: kv_role {tc.kv_role!r}: it only loads "
                             "(kv_consumer); WavePP is the prefiller")  # fmt: skip
        self.block_size = vllm_config.cache_config.block_size
        model = vllm_config.model_config
        self.hf = model.hf_text_config.to_dict()
        self.fp = plan.decoder_fingerprint(self.hf, model.dtype,
                                           str(vllm_config.cache_config.cache_dtype))  # fmt: skip
        par = vllm_config.parallel_config
        if par.tensor_parallel_size != 1 or par.pipeline_parallel_size != 1:
            raise plan.ModelRefused(
                "WavePPConnector: tensor- or pipeline-parallel decoders are not supported yet "
                f"(tp {par.tensor_parallel_size}, pp {par.pipeline_parallel_size})"
            )
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            raise plan.ModelRefused("WavePPConnector writes vLLM CPU's paged cache layout "
                                    "only; this vLLM runs on another platform")  # fmt: skip
        if tc.kv_load_failure_policy != "recompute":
            log.warning("WavePPConnector: kv_load_failure_policy is %r: a band that does not "
                        "arrive fails its request; set \"recompute\" to compute it instead",
                        tc.kv_load_failure_policy)  # fmt: skip
        self.allow = self.settings.allow
        self._secret = self.settings.secret
        self._verifier = auth.Verifier(self._secret) if self._secret else None
        self._lock = threading.Lock()  # the verifier's nonces and the figures, across threads
        self._figures = figures.empty()  # this step's, until get_kv_connector_stats
        # scheduler's side
        self._plans: dict[str, _Plan] = {}
        self._pending: list[LoadSpec] = []
        # worker's side
        self._pages: dict[int, plan.Pages] = {}
        self._loads: dict[str, _Load] = {}
        self._invalid: set[int] = set()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._gate = Gate(self.hf, self.fp.dtype, self.fp,
                          self.settings.max_band_bytes)  # fmt: skip
        log.info("WavePPConnector (%s): %s, %d layers, %d kv heads of %d, %s, block %d, %s",
                 role.name, self.fp.architecture, self.fp.num_layers, self.fp.num_kv_heads,
                 self.fp.head_dim, self.fp.dtype, self.block_size,
                 "signed pulls and bands" if self._secret else "unsigned")  # fmt: skip

    # -- the scheduler's side ------------------------------------------------------

    def _plan(self, request: Request) -> _Plan:
        got = self._plans.get(request.request_id)
        if got is not None:
            return got
        ids = list(request.prompt_token_ids or [])
        try:
            source = plan.parse_params(request.kv_transfer_params, self.fp.vocab_size,
                                       self.allow)  # fmt: skip
            got = _Plan(plan.agreed_tokens(ids, source, self.block_size), source)
        except plan.ParamsError as error:
            # a load error, not a crash: claim the blocks the load would have filled and
            # fail them at once (vLLM recomputes them, or fails the request, per policy)
            got = _Plan(len(ids) // self.block_size * self.block_size, None, str(error))
            COUNTS["params_refused"] += 1
            log.warning("WavePPConnector: request %s: %s", request.request_id, error)
        self._plans[request.request_id] = got
        return got

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if not plan.is_ours(request.kv_transfer_params):
            return 0, False
        more = self._plan(request).end - num_computed_tokens
        return (more, True) if more > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:  # fmt: skip
        params = request.kv_transfer_params
        if not plan.is_ours(params):
            return
        got = self._plan(request)
        if num_external_tokens <= 0:  # vLLM's own cache had the prefix: release the bands
            self._release(request, got)
            return
        b = self.block_size
        end, start = got.end, got.end - num_external_tokens
        block_ids = list(blocks.get_block_ids()[0])[start // b : end // b]
        error = got.error
        if not error and (start < 0 or start % b or len(block_ids) != (end - start) // b):
            error = (f"vLLM allocated {len(block_ids)} blocks for tokens {start}..{end} "
                     f"(block {b})")  # fmt: skip
        source = got.source
        ids = list(request.prompt_token_ids or [])[:end]
        self._pending.append(LoadSpec(
            req_id=request.request_id, wavepp_id=source.request_id if source else "",
            stages=source.stages if source else (), num_tokens=source.num_tokens if source
            else 0, start=start, end=end, block_ids=block_ids, digest=plan.token_digest(ids),
            error=error, arrival=request.arrival_time))  # fmt: skip
        params["do_remote_prefill"] = False  # loaded once: not again after a preemption

    def _release(self, request: Request, got: _Plan) -> None:
        """The request loads nothing (vLLM's own prefix cache had it, or it ended before it
        was scheduled): its bands are pulled and refused, which releases them on the
        stages now rather than at the end of their lease."""
        request.kv_transfer_params["do_remote_prefill"] = False
        if got.source is not None:
            s = got.source
            self._pending.append(LoadSpec(request.request_id, s.request_id, s.stages,
                                          s.num_tokens, 0, 0, [], "", release=True))  # fmt: skip

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = WavePPMetadata(self._pending)
        self._pending = []
        return meta

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:  # fmt: skip
        got = self._plans.pop(request.request_id, None)
        if plan.is_ours(request.kv_transfer_params):  # never allocated: aborted first
            self._release(request, got or self._plan(request))
            self._plans.pop(request.request_id, None)
        return False, None

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:  # fmt: skip
        return self.request_finished(request, [])

    # -- the worker's side ---------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(DTYPE_OF[self.fp.dtype], self.block_size, self.fp.head_dim)
        pages = {}
        for name, cache in kv_caches.items():
            layer = plan.layer_index(name)
            if layer in pages:
                raise plan.ModelRefused(f"WavePPConnector: two caches for layer {layer}")
            pages[layer] = plan.cpu_pages(cache, self.fp, self.block_size, isa, name)
        want = {i for i, kind in enumerate(self.fp.layer_kinds) if kind == "A"}
        if set(pages) != want:
            raise plan.ModelRefused(f"WavePPConnector: vLLM's caches are of layers "
                                    f"{sorted(pages)}, the model's attention layers "
                                    f"{sorted(want)}")  # fmt: skip
        self._pages = pages
        self._pool = concurrent.futures.ThreadPoolExecutor(
            self.settings.threads, thread_name_prefix="wavepp-pull"
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, WavePPMetadata):
            return
        now = time.monotonic()
        for spec in meta.loads:
            if spec.release:
                self._release_bands(spec)
                continue
            load = _Load(spec, now + self.settings.timeout_s, now)
            self._loads[spec.req_id] = load
            if spec.error:
                load.fail(spec.error, "params")
                continue
            if self._pool is None:
                load.fail("the connector's worker has no registered caches", "error")
                continue
            for s, address in enumerate(spec.stages):
                load.futures.append(self._pool.submit(self._pull, load, s, address))

    def _release_bands(self, spec: LoadSpec) -> None:
        """Refuse every stage's band of a request that loads nothing (not reported to
        vLLM: the request never waited for it)."""
        if self._pool is None:
            return
        deadline = time.monotonic() + self.settings.timeout_s
        why = "the decoder needs none of it (its own prefix cache had the prompt)"

        def one(stage: int, address: str) -> None:
            try:
                pull_band(address, self._pull_frame(spec, stage), self._gate,
                          num_stages=len(spec.stages), num_tokens=spec.num_tokens,
                          take=lambda t, x: None, deadline=deadline,
                          read_timeout_s=self.settings.read_timeout_s,
                          refuse=why, verify=self._verify)  # fmt: skip
                with self._lock:
                    COUNTS["released"] += 1
                    self._figures["released"].append(1)
            except Exception as error:  # the lease frees it anyway
                log.info("WavePPConnector: request %s: stage %d's band not released: %s",
                         spec.req_id, stage, error)  # fmt: skip

        for s, address in enumerate(spec.stages):
            self._pool.submit(one, s, address)

    def _pull_frame(self, spec: LoadSpec, stage: int) -> wire.Pull:
        """The pull of ``stage``'s band, signed when the stages share a secret."""
        return auth.sign_pull(wire.Pull(spec.wavepp_id, stage, self.fp), self._secret)

    def _verify(self, header: wire.BandHeader) -> None:
        """A band header's signature (``auth.AuthError`` unless signed with the secret,
        fresh, unseen); nothing without a secret."""
        if self._verifier is not None:
            with self._lock:
                self._verifier.header(header)

    def _pull(self, load: _Load, stage: int, address: str) -> None:
        spec = load.spec
        parts: dict[int, dict[str, torch.Tensor]] = {}

        def take(t: wire.TensorSpec, tensor: torch.Tensor) -> None:
            if t.layer == -1:
                if t.name == "tokens" and plan.token_digest(tensor[: spec.end].numpy()) != (
                        spec.digest):  # fmt: skip
                    raise wire.WireError(f"the band's prompt differs from the decoder's in "
                                         f"its first {spec.end} tokens")  # fmt: skip
                return
            got = parts.setdefault(t.layer, {})
            got[t.name] = tensor
            if {"k", "v"} - set(got):
                return
            pages = self._pages.get(t.layer)
            if pages is None:
                raise wire.WireError(f"layer {t.layer} has no cache in this vLLM")
            k, v = got.pop("k")[spec.start : spec.end], got.pop("v")[spec.start : spec.end]
            with load.lock:
                if load.closed:
                    raise PullFailed("the load ran out of time")
                if t.layer in load.layers:
                    raise wire.WireError(f"layer {t.layer} came twice")
                plan.write_pages(pages, spec.block_ids, k, v)
                load.layers[t.layer] = time.time()
                load.last_landed = time.monotonic()
                load.written_bytes += k.numel() * k.element_size() + v.numel() * v.element_size()

        def opened(sock: socket.socket) -> None:
            with load.lock:
                load.socks.append(sock)

        try:
            header = pull_band(address, self._pull_frame(spec, stage), self._gate,
                               num_stages=len(spec.stages), num_tokens=spec.num_tokens,
                               take=take, deadline=load.deadline,
                               read_timeout_s=self.settings.read_timeout_s,
                               opened=opened, verify=self._verify)  # fmt: skip
            with load.lock:
                load.received_bytes += wire.band_bytes(header)
        except PullFailed as error:
            with load.lock:
                load.fail(str(error), error.kind)
        except Exception as error:  # a bug here must fail the load, not vLLM's worker
            with load.lock:
                load.fail(f"stage {stage}: {type(error).__name__}: {error}", "error")

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: a request runs only once its load is reported

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:  # fmt: skip
        return  # a consumer saves nothing

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        now = time.monotonic()
        done = set()
        for req_id, load in list(self._loads.items()):
            finished = all(f.done() for f in load.futures)
            if not finished and now < load.deadline:
                continue
            with load.lock:
                load.closed = True  # a pull still running writes nothing from now on
                socks = list(load.socks)
                if not finished:
                    load.fail(f"not every stage's band came within "
                              f"{self.settings.timeout_s:g} s", "timeout")  # fmt: skip
                missing = sorted(set(self._pages) - set(load.layers))
                if not load.errors and missing:
                    load.fail(f"the bands left layers {missing} out", "incomplete")
            for sock in socks:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            self._report(load, now)
            del self._loads[req_id]
            done.add(req_id)
        return None, done or None

    def _report(self, load: _Load, now: float) -> None:
        spec = load.spec
        tokens = spec.end - spec.start
        record = {"request_id": spec.req_id, "wavepp_id": spec.wavepp_id, "start": spec.start,
                  "end": spec.end, "ok": not load.errors, "seconds": round(now - load.started, 4),
                  "error": load.errors[0] if load.errors else ""}  # fmt: skip
        LOADS.append(record)
        refusals = sum(reason == "refused" for reason in load.reasons)
        with self._lock:
            self._figures["refusals"].extend([1] * refusals)
            if load.errors:
                figures.record_error(self._figures, load.reasons[0])
            else:
                figures.record_load(self._figures, load.last_landed - load.started,
                                    [at - spec.arrival for at in load.layers.values()],
                                    load.written_bytes, load.received_bytes)  # fmt: skip
        if load.errors:
            self._invalid.update(spec.block_ids)
            COUNTS["failed"] += 1
            log.warning("WavePPConnector: request %s: load of tokens %d..%d failed (%d blocks "
                        "reported): %s", spec.req_id, spec.start, spec.end,
                        len(spec.block_ids), record["error"])  # fmt: skip
        else:
            COUNTS["loaded"] += 1
            COUNTS["tokens"] += tokens
            log.info("WavePPConnector: request %s: loaded tokens %d..%d from %d stages in "
                     "%.3f s", spec.req_id, spec.start, spec.end, len(spec.stages),
                     record["seconds"])  # fmt: skip

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out

    # -- vLLM's metrics ------------------------------------------------------------

    def get_kv_connector_stats(self) -> LoadStats | None:
        """This step's figures (``wavepp.vllm.stats``), then none until the next."""
        with self._lock:
            if figures.is_empty(self._figures):
                return None
            data, self._figures = self._figures, figures.empty()
        return LoadStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> LoadStats:
        return LoadStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict,
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> LoadMetrics:  # fmt: skip
        return LoadMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


DTYPE_OF = {name: dtype for dtype, name in plan.DTYPES.items()}
