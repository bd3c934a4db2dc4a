// Probe (s22): wgmma m64n16k16 f16 with A from registers (the mma.sync A-fragment layout per warp) and B from
// shared memory through a no-swizzle K-major descriptor; which (LBO, SBO) reading is right, and the D layout.
// nvcc -O2 -gencode=arch=compute_90a,code=sm_90a -o /tmp/wgprobe benchmarks/probes/wgmma_rs_layout.cu && /tmp/wgprobe
#include <cuda_fp16.h>
#include <stdint.h>
#include <stdio.h>
#include <math.h>

__device__ uint64_t desc(const void* p, int lbo, int sbo) {
    uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
    return (uint64_t)((a & 0x3FFFF) >> 4) | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(sbo >> 4) << 32);
}

__global__ void k(const float* A, const float* B, float* D, int lbo, int sbo) {
    // A [64][16] row-major, B [16 k][16 n]; smem B: core matrix (nb, kb) = 8 n rows x 8 k halves at nb*sbo + kb*lbo
    __shared__ __align__(128) __half sb[1024];
    const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
    for (int i = tid; i < 1024; i += 128) sb[i] = __float2half(0.f);
    __syncthreads();
    for (int i = tid; i < 256; i += 128) {
        int kk = i / 16, n = i % 16, nb = n / 8, kb = kk / 8;
        int off = nb * sbo + kb * lbo + (n % 8) * 16 + (kk % 8) * 2;  // bytes
        sb[off / 2] = __float2half(B[kk * 16 + n]);
    }
    __syncthreads();
    auto pk = [&](int r, int kk) {
        __half2 h = __floats2half2_rn(A[r * 16 + kk], A[r * 16 + kk + 1]);
        return *reinterpret_cast<uint32_t*>(&h);
    };
    const int r0 = 16 * w + g;
    uint32_t a0 = pk(r0, 2 * c), a1 = pk(r0 + 8, 2 * c), a2 = pk(r0, 2 * c + 8), a3 = pk(r0 + 8, 2 * c + 8);
    float d[8] = {};
    uint64_t db = desc(sb, lbo, sbo);
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(db), "r"(0));
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    // assumed D layout: n8 block j: d[4j+0,1] = (row g, cols 8j+2c, +1), d[4j+2,3] = (row g+8, ...)
    for (int j = 0; j < 2; ++j)
        for (int e = 0; e < 4; ++e) {
            int r = r0 + ((e & 2) ? 8 : 0), col = 8 * j + 2 * c + (e & 1);
            D[r * 16 + col] = d[4 * j + e];
        }
}

__global__ void mm(int* bad) {  // movmatrix.trans: lane (g, c) holds (row g, cols 2c, 2c+1) before and after
    const int lane = threadIdx.x, g = lane >> 2, c = lane & 3;
    __half2 h = __floats2half2_rn((float)(g * 8 + 2 * c), (float)(g * 8 + 2 * c + 1));
    uint32_t x = *reinterpret_cast<uint32_t*>(&h), y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
    __half2 o = *reinterpret_cast<__half2*>(&y);
    if (__low2float(o) != (float)(2 * c * 8 + g) || __high2float(o) != (float)((2 * c + 1) * 8 + g)) atomicAdd(bad, 1);
}

int main() {
    float hA[64 * 16], hB[256], hD[1024], ref[1024];
    for (int i = 0; i < 1024; ++i) hA[i] = (float)((i * 37 % 17) - 8) / 8.f;
    for (int i = 0; i < 256; ++i) hB[i] = (float)((i * 53 % 13) - 6) / 4.f;
    for (int r = 0; r < 64; ++r)
        for (int n = 0; n < 16; ++n) {
            float s = 0;
            for (int kk = 0; kk < 16; ++kk) s += hA[r * 16 + kk] * hB[kk * 16 + n];
            ref[r * 16 + n] = s;
        }
    float *A, *B, *D;
    cudaMalloc(&A, sizeof hA); cudaMalloc(&B, sizeof hB); cudaMalloc(&D, sizeof hD);
    cudaMemcpy(A, hA, sizeof hA, cudaMemcpyHostToDevice); cudaMemcpy(B, hB, sizeof hB, cudaMemcpyHostToDevice);
    int variants[4][2] = {{128, 256}, {256, 128}, {128, 128}, {256, 256}};
    for (auto& v : variants) {
        cudaMemset(D, 0, sizeof hD);
        k<<<1, 128>>>(A, B, D, v[0], v[1]);
        cudaError_t e = cudaDeviceSynchronize();
        cudaMemcpy(hD, D, sizeof hD, cudaMemcpyDeviceToHost);
        float err = 0;
        for (int i = 0; i < 1024; ++i) err = fmaxf(err, fabsf(hD[i] - ref[i]));
        printf("LBO %d SBO %d: %s max abs err %g\n", v[0], v[1], cudaGetErrorString(e), err);
    }
    int* bad; int hb = 0;
    cudaMalloc(&bad, 4); cudaMemset(bad, 0, 4);
    mm<<<1, 32>>>(bad);
    cudaMemcpy(&hb, bad, 4, cudaMemcpyDeviceToHost);
    printf("movmatrix.trans lanes wrong: %d\n", hb);
    return 0;
}
