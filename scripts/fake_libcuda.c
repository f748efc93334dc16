/* A stand-in for the CUDA driver (libcuda.so.1) that lets Mosaic GPU's compiler run on a machine without a GPU.

   scripts/mosaic_sass.py loads it (LD_LIBRARY_PATH) in a child process that calls the CUDA plugin's
   MosaicGpuCompile. That compiler asks the driver only for the device's compute capability, then builds PTX
   and SASS (ptxas) and loads the module. This library reports one Hopper device (sm_90), hands out dummy
   handles for the load, and runs nothing. Set FAKECUDA_TRACE=1 to see which entry points are called. */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;                       /* 0 = CUDA_SUCCESS */

static void trace(const char *name) {
  if (getenv("FAKECUDA_TRACE")) fprintf(stderr, "fakecuda: %s\n", name);
}

static void *const CONTEXT = (void *)0x1000, *const MODULE = (void *)0x2000, *const FUNCTION = (void *)0x3000;

CUresult cuInit(unsigned flags) { trace("cuInit"); return 0; }
CUresult cuDriverGetVersion(int *version) { trace("cuDriverGetVersion"); *version = 12080; return 0; }
CUresult cuDeviceGet(int *device, int ordinal) { trace("cuDeviceGet"); *device = 0; return 0; }
CUresult cuDeviceGetCount(int *count) { trace("cuDeviceGetCount"); *count = 1; return 0; }
CUresult cuDeviceGetName(char *name, int len, int device) {
  strncpy(name, "NVIDIA H100 80GB HBM3 (stand-in)", len);
  return 0;
}
CUresult cuDeviceGetAttribute(int *value, int attribute, int device) {
  trace("cuDeviceGetAttribute");
  switch (attribute) {
    case 75: *value = 9; break;             /* CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR */
    case 76: *value = 0; break;             /* ..._MINOR */
    case 97: *value = 232448; break;        /* MAX_SHARED_MEMORY_PER_BLOCK_OPTIN */
    case 16: *value = 132; break;           /* MULTIPROCESSOR_COUNT */
    case 1: *value = 1024; break;           /* MAX_THREADS_PER_BLOCK */
    default: *value = 0;
  }
  return 0;
}
CUresult cuCtxGetDevice(int *device) { trace("cuCtxGetDevice"); *device = 0; return 0; }
CUresult cuCtxGetCurrent(void **ctx) { trace("cuCtxGetCurrent"); *ctx = CONTEXT; return 0; }
CUresult cuCtxSetCurrent(void *ctx) { return 0; }
CUresult cuCtxPushCurrent_v2(void *ctx) { return 0; }
CUresult cuCtxPopCurrent_v2(void **ctx) { if (ctx) *ctx = CONTEXT; return 0; }
CUresult cuCtxSynchronize(void) { return 0; }
CUresult cuDevicePrimaryCtxRetain(void **ctx, int device) { *ctx = CONTEXT; return 0; }
CUresult cuGetErrorString(int error, const char **text) { *text = "error from the stand-in CUDA driver"; return 0; }
CUresult cuGetErrorName(int error, const char **text) { *text = "FAKECUDA_ERROR"; return 0; }
CUresult cuModuleLoadData(void **module, const void *image) { trace("cuModuleLoadData"); *module = MODULE; return 0; }
CUresult cuModuleLoadDataEx(void **module, const void *image, unsigned n, void *options, void **values) {
  trace("cuModuleLoadDataEx");
  *module = MODULE;
  return 0;
}
CUresult cuModuleGetFunction(void **function, void *module, const char *name) {
  trace("cuModuleGetFunction");
  *function = FUNCTION;
  return 0;
}
CUresult cuModuleGetGlobal_v2(unsigned long long *ptr, size_t *bytes, void *module, const char *name) {
  trace("cuModuleGetGlobal");
  if (ptr) *ptr = 0x4000;
  if (bytes) *bytes = 8;
  return 0;
}
CUresult cuModuleUnload(void *module) { return 0; }
CUresult cuFuncSetAttribute(void *function, int attribute, int value) { return 0; }
CUresult cuFuncGetAttribute(int *value, int attribute, void *function) { *value = 0; return 0; }
