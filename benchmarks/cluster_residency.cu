// How many thread-block clusters a GPU keeps resident at once, by cluster size, threads and shared memory per block:
// cudaOccupancyMaxActiveClusters for a kernel that takes `smem` KB of dynamic shared memory (capped at the device's
// opt-in maximum). deepep::cartpole_rollout_clusters launches clusters of 8 blocks of 256 threads with 146-228 KB
// each (one block per SM); a cluster's blocks must share a GPC, so the count depends on the chip's GPCs as well as
// its SM count. The kernel's launch asks the same question (automatic_rows in
// extensions/csrc/deepep/cuda/cartpole_rollout_clusters.cu).
//
//   nvcc -O2 -std=c++17 -gencode arch=compute_90,code=sm_90 benchmarks/cluster_residency.cu -o /tmp/cluster_residency
//   /tmp/cluster_residency > benchmarks/results/train_step/cluster_residency.txt
#include <cstdio>
#include <cuda_runtime.h>

__global__ void k(float* p) {
  extern __shared__ float s[];
  s[threadIdx.x] = 1;
  if (p) p[0] = s[0];
}

int main() {
  cudaDeviceProp prop;
  const cudaError_t found = cudaGetDeviceProperties(&prop, 0);
  if (found != cudaSuccess) {
    fprintf(stderr, "cluster_residency: no CUDA device (%s)\n", cudaGetErrorString(found));
    return 1;
  }
  printf("%s SMs %d smemOptin %zu smemPerSM %zu\n", prop.name, prop.multiProcessorCount, prop.sharedMemPerBlockOptin,
         prop.sharedMemPerMultiprocessor);
  int threads[] = {256, 512};
  int kbs[] = {120, 176, 190, 209, 227};
  for (int cl : {2, 4, 8, 16})
    for (int t : threads)
      for (int kb : kbs) {
        size_t bytes = kb * 1024;
        if (bytes > prop.sharedMemPerBlockOptin) bytes = prop.sharedMemPerBlockOptin;
        cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
        if (cl > 8) cudaFuncSetAttribute(k, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
        cudaLaunchConfig_t c = {};
        c.gridDim = dim3(cl * 32);
        c.blockDim = dim3(t);
        c.dynamicSmemBytes = bytes;
        cudaLaunchAttribute a[1];
        a[0].id = cudaLaunchAttributeClusterDimension;
        a[0].val.clusterDim.x = cl;
        a[0].val.clusterDim.y = 1;
        a[0].val.clusterDim.z = 1;
        c.attrs = a;
        c.numAttrs = 1;
        int n = -1;
        cudaError_t e = cudaOccupancyMaxActiveClusters(&n, k, &c);
        printf("cluster %2d threads %d smem %3d KB -> max active clusters %d (%s)\n", cl, t, kb, n, cudaGetErrorString(e));
      }
}
