"""Probe: the mse grid with another candidate ladder (lowbit.quant.affine.MSE_STEPS patched), then `lowbit ...`."""
import sys
import lowbit.quant.affine as A
lo, hi, n = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
A.MSE_STEPS = tuple(lo + (hi - lo) * i / (n - 1) for i in range(n))
print("MSE_STEPS", [round(x, 3) for x in A.MSE_STEPS], file=sys.stderr)
from lowbit.cli import main
sys.exit(main(sys.argv[4:]))
