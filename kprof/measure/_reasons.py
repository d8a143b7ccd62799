"""NVML's clock-event reasons: the bits and their labels, for the telemetry sampler and the state protocol."""

from __future__ import annotations

__all__ = ["REASON_BITS", "decode_reasons"]

# nvmlClocksEventReason* bits (nvmlClocksThrottleReason* before driver 535; the same values). Both
# thermal slowdowns read as "thermal": the row only needs to know that heat, not power, held the clock.
REASON_BITS: dict[int, str] = {
    0x001: "idle",  # GpuIdle: nothing ran on the GPU
    0x002: "app_clocks",  # ApplicationsClocksSetting
    0x004: "power_cap",  # SwPowerCap: the power limit held the clock down
    0x008: "hw_slowdown",  # HwSlowdown
    0x010: "sync_boost",  # SyncBoost
    0x020: "thermal",  # SwThermalSlowdown
    0x040: "thermal",  # HwThermalSlowdown
    0x080: "hw_power_brake",  # HwPowerBrakeSlowdown
    0x100: "display_clocks",  # DisplayClockSetting
    0x200: "board_limit",  # BoardLimit (only in the older Throttle names)
    0x400: "reliability",  # Reliability (only in the older Throttle names)
}


def decode_reasons(mask: int) -> list[str]:
    """Sorted labels of a clock-event-reasons bitmask; a bit this table does not know reads `unknown_0x...`."""
    labels = set()
    for bit in range(64):
        if mask >> bit & 1:
            labels.add(REASON_BITS.get(1 << bit, f"unknown_{1 << bit:#x}"))
    return sorted(labels)
