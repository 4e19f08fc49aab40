# Diagnosis: a TORCH_CHECK failing inside a deepep op crashed torch 2.11 with SIGSEGV (refused_tests).
# Each case in its own process; a C++ backtrace under gdb when gdb exists.
diag() {
  local name=$1; shift
  run "throw_$name" 60 python3 -X faulthandler -c "
import torch
from deepep_lightning.ops import extension_available; assert extension_available()
$*
print('raised cleanly' if ok else 'no error')"
}
diag all_action_q "ok=False
try: torch.ops.deepep.all_action_q(torch.randn(3,4), torch.randn(2,5), torch.randn(5,4), torch.randn(()), True)
except RuntimeError as e: ok=True; print(str(e)[:200])"
diag gs_backward_cpu_kernel "ok=False
try: torch.ops.deepep.grid_sample_bilinear2d_backward(torch.randn(2,3,4,4), torch.randn(2,3,5,5), torch.randn(1,4,4,2), 0, False, True)
except RuntimeError as e: ok=True; print(str(e)[:200])"
diag gs_no_grad "ok=False
try: torch.ops.deepep.grid_sample_bilinear2d(torch.randn(2,3,5,5), torch.randn(1,4,4,2), 0, False)
except RuntimeError as e: ok=True; print(str(e)[:200])"
diag gs_requires_grad "ok=False
try: torch.ops.deepep.grid_sample_bilinear2d(torch.randn(2,3,5,5,requires_grad=True), torch.randn(1,4,4,2), 0, False)
except RuntimeError as e: ok=True; print(str(e)[:200])"
diag plain_torch_check "ok=False
try: torch.mm(torch.randn(2,3), torch.randn(4,5))
except RuntimeError as e: ok=True; print(str(e)[:200])"
if command -v gdb > /dev/null; then
  run throw_gdb 90 gdb -batch -ex run -ex bt --args python3 -c "
import torch
from deepep_lightning.ops import extension_available; assert extension_available()
torch.ops.deepep.grid_sample_bilinear2d(torch.randn(2,3,5,5), torch.randn(1,4,4,2), 0, False)"
else
  echo "no gdb" > "$R/throw_gdb.txt"
fi
g++ --version > "$R/gxx_version.txt" 2>&1; python3 -c "import torch; print(torch.__version__, torch._C._GLIBCXX_USE_CXX11_ABI, torch.compiled_with_cxx11_abi())" >> "$R/gxx_version.txt" 2>&1
