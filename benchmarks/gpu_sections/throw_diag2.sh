# Diagnosis, part 2: the built library's unwind tables and link line, and whether a CPU-only build also crashes.
SO=$(ls /tmp/torch_extensions/deepep_lightning_ext_cuda/*.so 2>/dev/null | head -1)
{ echo "== $SO"; readelf -lW "$SO" | grep -iE "EH_FRAME|eh_frame"; readelf -SW "$SO" | grep -iE "eh_frame|except";
  echo "== ldd"; ldd "$SO" | grep -iE "gcc|stdc|c10.so|torch_cpu";
  echo "== build.ninja"; grep -E "^(cflags|cuda_cflags|cuda_post_cflags|ldflags|cxx|nvcc) " /tmp/torch_extensions/deepep_lightning_ext_cuda/build.ninja;
  echo "== python libstdc++"; python3 -c "import torch,re;print([l.split()[-1] for l in open('/proc/self/maps') if 'libstdc' in l or 'libgcc_s' in l][:4])";
} > "$R/throw_diag2.txt" 2>&1
CUDA_VISIBLE_DEVICES= TORCH_EXTENSIONS_DIR=/tmp/te_cpu run throw_cpu_build 120 python3 -X faulthandler -c "
import torch
from deepep_lightning.ops import extension_available, cuda_kernels_available; assert extension_available() and not cuda_kernels_available()
try: torch.ops.deepep.grid_sample_bilinear2d(torch.randn(2,3,5,5), torch.randn(1,4,4,2), 0, False)
except RuntimeError as e: print('raised cleanly:', str(e)[:120])"
SO2=$(ls /tmp/te_cpu/deepep_lightning_ext_cpu/*.so 2>/dev/null | head -1)
{ echo "== $SO2"; readelf -lW "$SO2" | grep -iE "EH_FRAME"; } >> "$R/throw_diag2.txt" 2>&1
