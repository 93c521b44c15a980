"""Where an eager short call's host time goes: B8 H16 D128 bf16, 128x128 blocks at density 0.5. Host times per
call (enqueue only: calls back to back, no waiting for the GPU; the fastest of 7 rounds, as the machine's host
noise is large) of the public call, the argument preparation and the launcher, with launch plans on and off (and
on for the warp-specialized Gluon kernels too, forward_ws.LAUNCH_PLANS) and with descriptor loads on and off; then
the same for forward + backward, and a cProfile table of an eager forward + backward with plans.

    python benchmarks/host_cost.py [--seq 1024] [--calls 300]
"""

import argparse

import torch

from blockattn import api
from blockattn.kernels import forward_ws, launch, ops, tma

from exp_short import host_ms, print_profile, short_case, short_inputs


def per_call_us(fn, calls: int, rounds: int = 7) -> float:
    """The fastest of rounds of exp_short.host_ms (host time per call, calls enqueued back to back), in us."""
    return min(host_ms(fn, calls) for _ in range(rounds)) * 1e3


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    fwd, fwd_bwd = short_case(8, 16, args.seq, 0.5)
    q, k, v, blocks, _ = short_inputs(8, 16, args.seq, 0.5)

    def prepare():
        p = api._prepare(q, k, v, blocks, None, "bhsd", None, None, None, None, False, None, None, "auto")
        return p, api._op_args(p, False, need_q_lists=False)
    p, op_args = prepare()

    def launcher():
        with torch.no_grad():
            ops.forward_eager(p.q, p.k, p.v, *op_args)
    print(f"S{args.seq}: _prepare + _op_args {per_call_us(prepare, args.calls):.1f} us", flush=True)
    default_gluon_plans = forward_ws.LAUNCH_PLANS
    # plans: the Triton kernels' (launch.ENABLED); "all": the warp-specialized Gluon kernels' too (LAUNCH_PLANS)
    for plans in ("all", True, False):
        launch.ENABLED, forward_ws.LAUNCH_PLANS = bool(plans), plans == "all"
        for descriptors in (True, False):
            if plans == "all" and not descriptors:
                continue  # without descriptor loads no Gluon kernel runs
            tma.TMA_LOADS = descriptors
            fwd(), launcher(), fwd_bwd()
            label = f"S{args.seq} plans={plans} descriptors={descriptors}"
            print(f"{label}: forward launcher {per_call_us(launcher, args.calls):.1f} us, attention() forward "
                  f"{per_call_us(fwd, args.calls):.1f} us, forward + backward {per_call_us(fwd_bwd, args.calls // 3):.1f}"
                  " us", flush=True)
    launch.ENABLED, tma.TMA_LOADS, forward_ws.LAUNCH_PLANS = True, True, default_gluon_plans
    fwd_bwd()
    print_profile(fwd_bwd, 100)


if __name__ == "__main__":
    main()
