"""Which CPU kernel paths run, for the whole process: the SIMD level, AVX-512 VNNI, AMX tiles
and the exact kernels' subnormal quants. Every path computes the same results (the int8 and int16
precisions' paths among themselves); these switches exist to test and time each one, and the
worker sets the SIMD level from its EngineOptions on Load. Nothing reads the environment."""

from __future__ import annotations

from .native import library as _C


def _switch(name: str, enabled: bool) -> None:
    """Calls the compiled setting `name` with 0 or 1; refuses anything but a bool."""
    if not isinstance(enabled, bool):
        raise ValueError(f"{name} takes True or False, not {enabled!r}")
    if _C is not None:
        getattr(_C, name)(int(enabled))


SIMD_LEVELS = ("portable", "avx2", "avx512")


def set_cpu_simd(enabled: bool | str) -> None:
    """Allow (True, the default: the widest path the CPU has) or forbid (False: the portable
    loops) the CPU kernels' SIMD paths for the whole process, or cap them at a level of
    SIMD_LEVELS (to test or time each path; a level the CPU lacks falls back to the next
    narrower one). Every path computes the same results. The worker calls this on Load with its
    EngineOptions; nothing reads the environment for it."""
    if isinstance(enabled, str):
        if enabled not in SIMD_LEVELS:
            raise ValueError(f"SIMD level must be one of {', '.join(SIMD_LEVELS)}, not {enabled!r}")
        level = SIMD_LEVELS.index(enabled)
    else:
        level = len(SIMD_LEVELS) - 1 if enabled else 0
    if _C is not None:
        _C.set_cpu_simd(level)


def set_cpu_vnni(enabled: bool) -> None:
    """Allow (True, the default) or forbid the AVX-512 VNNI paths (the int8 and int16
    precisions' integer dot products) where the CPU has them: forbidden, an AVX-512 CPU with
    VNNI takes the paths of one without it (AVX2's integer kernels, beside AVX-512's float
    ones), to test and time them."""
    _switch("set_cpu_vnni", enabled)


def set_cpu_amx(enabled: bool) -> None:
    """Allow (True, the default) or forbid the int8 precision's AMX path where the CPU has AMX
    int8 tiles (Intel Xeon from Sapphire Rapids on): forbidden, its many-row products take the
    VNNI kernels, which compute the same results bit for bit, to test and time them."""
    _switch("set_cpu_amx", enabled)


def cpu_amx_active() -> bool:
    """Whether the int8 precision's many-row products take AMX tiles now: this CPU and OS have
    them, and set_cpu_amx, set_cpu_vnni and set_cpu_simd allow them."""
    return bool(_C is not None and _C.cpu_amx_active())


def cpu_simd_active() -> bool:
    """Whether the CPU kernels take a SIMD path now (AVX2, or AVX-512 where the CPU has it): SIMD
    allowed by set_cpu_simd and at least AVX2 supported by this CPU."""
    return bool(_C is not None and _C.cpu_simd_active())


def set_cpu_subnormal_quants(mode: bool | str) -> None:
    """Whether the exact 4- to 6-bit kernels read their quants as float32 subnormals instead of
    converting them (csrc/cpu/subnormal.h: the same results, bit for bit, with one vector op
    fewer per 8 or 16 weights): "auto" (the default) where a timing at first use finds this CPU
    takes subnormal FMA inputs at full speed, True always (with AVX2; to test the path), False
    never."""
    if mode == "auto":
        value = 2
    elif isinstance(mode, bool):
        value = int(mode)
    else:
        raise ValueError(f"subnormal quants must be True, False or 'auto', not {mode!r}")
    if _C is not None:
        _C.set_cpu_subnormal_quants(value)


def cpu_subnormal_quants_active() -> bool:
    """Whether the exact 4- to 6-bit kernels read quants as subnormals now
    (set_cpu_subnormal_quants, a SIMD path, and on "auto" the probe)."""
    return bool(_C is not None and _C.cpu_subnormal_quants_active())
