"""Conditional flow matching: the fixed start noise, the cosine time grid and the Euler/CFG solver
around the DiT (float32 reference path, or :class:`~cosyllama.flow.fast_dit.FastDiT`)."""

from __future__ import annotations

import torch
from torch import nn

from ..config import FlowConfig
from ..errors import InputError
from ..precision import INT8
from ..weight_copies import WeightCopies, weights_key
from .cache import LOWP_KV_DTYPE, FlowStreamCache, StepCache
from .dit import DiT
from .fast_dit import INT8_ENGINE, INT8_ENGINES, FastDiT, int8_engine_problem, int8_is_static

NOISE_SEED = 0  # upstream seeds the global RNG with 0 right before drawing the ODE start noise
NOISE_FRAMES = 15_000  # mel frames in the fixed noise buffer (300 s at 50 frames/s, prompt included)


def flow_noise(n_mels: int = 80, frames: int = NOISE_FRAMES) -> torch.Tensor:
    """The fixed ODE start noise ``(1, n_mels, frames)`` float32, bit-equal to upstream's
    ``torch.manual_seed(0); torch.randn(1, 80, 15000)``. Drawn on a private CPU generator so the
    global RNG is left alone."""
    gen = torch.Generator(device="cpu").manual_seed(NOISE_SEED)
    return torch.randn(1, n_mels, frames, generator=gen)


def cosine_t_span(n_steps: int) -> torch.Tensor:
    """Euler time grid ``1 - cos(linspace(0, 1, n+1) * pi/2)``, float32 ``(n+1,)``."""
    lin = torch.linspace(0, 1, n_steps + 1, dtype=torch.float32)
    return 1 - torch.cos(lin * 0.5 * torch.pi)


# ----------------------------------------------------------------------------------------------
# Conditional flow matching sampler


class CFM(nn.Module):
    """Euler ODE solver with classifier-free guidance around :class:`DiT` (see docs/reference.md#cfm-solver)."""

    def __init__(self, cfg: FlowConfig):
        super().__init__()
        if cfg.t_scheduler != "cosine":
            raise InputError(f"flow t_scheduler {cfg.t_scheduler!r} is not supported; only 'cosine' is")
        self.n_timesteps = cfg.n_timesteps
        self.cfg_rate = cfg.inference_cfg_rate
        self.estimator = DiT(cfg)
        self.register_buffer("rand_noise", flow_noise(cfg.mel_dim), persistent=False)
        # float32: the reference solver below. bfloat16 / INT8: the mixed-precision solver (FastDiT).
        self.compute_dtype = torch.float32
        self.int8_engine = INT8_ENGINE  # PyTorch's int8 kernel library at INT8 (fast_dit.INT8_ENGINES)
        self._fast: WeightCopies[FastDiT] = WeightCopies(FastDiT)  # the fast solver's weight copies
        # a static int8 engine's calibrated scales, with the weights and step count they were taken on
        self.static_scales: tuple | None = None
        self._scales_for: tuple | None = None
        self._observer: FastDiT | None = None  # set during calibrate_static: the solver that records ranges
        self._calibrated: tuple | None = None  # ((weights key, steps), scales) of the last calibration

    def set_compute_dtype(self, dtype: torch.dtype, int8_engine: str | None = None,
                          static_scales: tuple | None = None) -> None:
        """float32: the reference solver; else :class:`FastDiT` in ``dtype`` (at INT8 on ``int8_engine``,
        default :data:`~cosyllama.flow.fast_dit.INT8_ENGINE`), its weight copies made now (not inside the
        first, timed, request). A static int8 engine needs ``static_scales`` from :meth:`calibrate_static`
        on these weights and this step count (:func:`cosyllama.flow.check.static_scales` caches them)."""
        engine = int8_engine or INT8_ENGINE
        if engine not in INT8_ENGINES:  # named at any dtype; whether it runs here matters at INT8 only
            raise InputError(int8_engine_problem(engine))
        problem = int8_engine_problem(engine, on_cpu=self.rand_noise.device.type == "cpu") if dtype == INT8 else None
        if problem:
            raise InputError(problem)
        static = dtype == INT8 and int8_is_static(engine)
        if static and static_scales is None:
            raise InputError(f"int8 engine {engine!r} needs static scales calibrated on these weights: "
                             "cosyllama.flow.check.Candidate(INT8, engine).apply(flow) makes them")
        self.compute_dtype, self.int8_engine = dtype, engine
        self.static_scales = static_scales if static else None
        self._scales_for = (self.weights_key(), self.n_timesteps) if static else None
        self._fast.drop()
        if dtype != torch.float32:
            self._fast_solver()

    def calibrate_static(self, solve) -> tuple:
        """The static int8 scales of these weights: ``solve()`` runs a calibration solve (through the
        flow, so the DiT sees real encoder output) on the dynamic mixed path while the inputs of every
        block's products are observed per Euler step; returns :meth:`FastDiT.static_scales`. The solver
        is left as it was."""
        problem = int8_engine_problem("onednn+bf16", on_cpu=self.rand_noise.device.type == "cpu")
        if problem:
            raise InputError(problem)
        observer = FastDiT(self.estimator, INT8, "onednn+bf16", observe=True)
        saved = self.compute_dtype
        self.compute_dtype, self._observer = INT8, observer
        try:
            solve()
        finally:
            self.compute_dtype, self._observer = saved, None
        scales = observer.static_scales(self.n_timesteps)
        self._calibrated = ((self.weights_key(), self.n_timesteps), scales)
        return scales

    def calibrated_scales(self) -> tuple | None:
        """The scales of the last :meth:`calibrate_static`, if taken on these weights at this step count."""
        hit = self._calibrated
        return hit[1] if hit is not None and hit[0] == (self.weights_key(), self.n_timesteps) else None

    def weights_key(self) -> tuple:
        """Changes whenever a weight of the estimator changes (see :mod:`cosyllama.weight_copies`)."""
        return weights_key(self.estimator)

    def time_grid(self) -> list[torch.Tensor]:
        """The ``(t, dt)`` pairs of the Euler steps, each a float32 ``(1,)`` tensor, accumulated
        exactly as the reference solver does."""
        t_span = cosine_t_span(self.n_timesteps).to(self.rand_noise.device)
        t, dt = t_span[0:1], t_span[1] - t_span[0]
        out = []
        for step in range(1, len(t_span)):
            out.append((t, dt))
            t = t + dt
            if step < len(t_span) - 1:
                dt = t_span[step + 1] - t
        return out

    def _check_length(self, n: int) -> None:
        if n > self.rand_noise.shape[2]:
            raise InputError(f"flow input of {n} mel frames (prompt included) exceeds the "
                             f"{self.rand_noise.shape[2]}-frame noise buffer (300 s)")

    def _fast_solver(self) -> FastDiT:
        if self._observer is not None:
            return self._observer
        if self.static_scales is not None and self._scales_for != (self.weights_key(), self.n_timesteps):
            raise InputError(f"the int8 engine {self.int8_engine!r} was calibrated on other weights or another "
                             "step count; set the flow's precision again")
        return self._fast.get(self.estimator, self.compute_dtype, self.int8_engine, self.static_scales)

    def kv_bytes_per_frame(self) -> int:
        """Bytes a streaming cache holds per mel frame: K and V of both CFG rows, every block and step."""
        blk = self.estimator.transformer_blocks
        inner = blk[0].attn.to_k.out_features if len(blk) else 0
        item = torch.empty(0, dtype=self.kv_cache_dtype()).element_size()
        return self.n_timesteps * len(blk) * 2 * 2 * inner * item

    def kv_cache_dtype(self) -> torch.dtype:
        """The dtype a streaming cache keeps K/V in: float32 for the reference solver, else
        :data:`~cosyllama.flow.cache.LOWP_KV_DTYPE` (bfloat16, also for int8)."""
        return torch.float32 if self.compute_dtype == torch.float32 else LOWP_KV_DTYPE

    def forward_cached(self, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
                       cache: FlowStreamCache, key: tuple, ids: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` with ``streaming=True``, resuming from ``cache`` where it belongs to this
        call (``key``: what besides the ids the frames depend on; ``ids``: prompt + token ids) and
        leaving it filled with this call's complete blocks, within its bound. Same output."""
        n = mu.shape[2]
        self._check_length(n)
        chunk = self.estimator.static_chunk_size
        key = (self, self.weights_key(), self.compute_dtype, self.int8_engine, self.n_timesteps, self.cfg_rate,
               chunk) + tuple(key)
        start = keep = 0
        if chunk > 0 and len(self.estimator.transformer_blocks):
            start = cache.start(key, ids, n, chunk)
            keep = max(start, min(n // chunk * chunk, cache.limit_frames(self.kv_bytes_per_frame(), chunk)))
        if keep == 0:  # nothing to reuse or keep (bound below one block): plain recomputation
            cache.clear()
            return self.forward(mu, spks, cond, streaming=True)
        cache.calls += 1
        cache.last_start = start
        cache.reused_frames += start
        cache.computed_frames += n - start
        if start == n:  # the same call again
            return cache.mel[:, :, :n].clone()
        try:
            x = self.forward(mu, spks, cond, streaming=True, cache=cache, keep=keep)
        except BaseException:
            cache.clear()  # possibly half replaced
            raise
        if start:
            x = torch.cat([cache.mel[:, :, :start], x], dim=2)
        cache.commit(key, ids, keep, x)
        return x

    def forward(self, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor, streaming: bool = False,
                cache: FlowStreamCache | None = None, keep: int = 0) -> torch.Tensor:
        """mu, cond ``(B, 80, N)``, spks ``(B, 80)`` -> ODE state at t=1 ``(B, 80, N)`` float32.

        B > 1: several requests of equal length N solved together, every row from the same fixed
        noise; the CFG batch is then ``[B conditional rows, B unconditional rows]``. Each row's
        maths is that of a B = 1 call (no operation mixes rows), so a row equals its own solve up
        to float rounding (matrix-product kernels may block a larger batch differently). At int8
        with dynamic scales the rows are solved one after another (its per-call activation scale
        would mix them); static scales depend on no row, so those rows are solved together.

        With ``cache`` (from :meth:`forward_cached`, which checks it belongs to these inputs; B = 1
        only): only frames ``cache.frames..N-1`` are computed and returned, and the cache is
        extended to frames ``0..keep-1`` (see :class:`StepCache`)."""
        b, n = mu.shape[0], mu.shape[2]
        self._check_length(n)
        if cache is not None and b != 1:
            raise InputError(f"a flow stream cache serves one request; got a batch of {b}")
        if b > 1 and self.compute_dtype == INT8 and self.static_scales is None:
            # the dynamic activation scale spans the rows of a call: one at a time (static scales do not)
            return torch.cat([self.forward(mu[i:i + 1], spks[i:i + 1], cond[i:i + 1], streaming) for i in range(b)])
        if self.compute_dtype != torch.float32:
            return self._fast_solver().solve_from(self.rand_noise[:, :, :n].float(), mu.float(), spks.float(),
                                                  cond.float(), self.time_grid(), self.cfg_rate, streaming,
                                                  cache, keep, self.kv_cache_dtype())
        start = 0 if cache is None else cache.frames
        x = self.rand_noise[:, :, start:n].to(mu.dtype).expand(b, -1, -1)
        t_span = cosine_t_span(self.n_timesteps).to(mu.device)
        # Rows B.. of the CFG batch are the unconditional branch: mu, spks and cond all zeroed.
        mu_in = torch.cat([mu, torch.zeros_like(mu)])[:, :, start:]
        spks_in = torch.cat([spks, torch.zeros_like(spks)])
        cond_in = torch.cat([cond, torch.zeros_like(cond)])[:, :, start:]
        # t is accumulated (t += dt) and dt re-derived from it, as upstream does, so the times the
        # estimator sees carry the same float32 rounding.
        t = t_span[0:1]
        dt = t_span[1] - t_span[0]
        for step in range(1, len(t_span)):
            past = None if cache is None else StepCache(cache, step - 1, keep, streaming, self.kv_cache_dtype())
            v = self.estimator(torch.cat([x, x]), mu_in, t.expand(2 * b), spks_in, cond_in, streaming, past=past)
            v_cond, v_uncond = v[:b], v[b:]
            x = x + dt * ((1.0 + self.cfg_rate) * v_cond - self.cfg_rate * v_uncond)
            t = t + dt
            if step < len(t_span) - 1:
                dt = t_span[step + 1] - t
        return x.float()
