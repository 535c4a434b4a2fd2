// Loads the kernels' fatbin once per process with the driver API (libmlx
// links the CUDA runtime statically, so kernels registered with our own
// runtime would be invisible to MLX's graphs).
#include "loader.h"

#include <dlfcn.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <mutex>
#include <stdexcept>
#include <unordered_map>

#include "cuda_head.h"

namespace flash_cce::cuda {

void check(CUresult r, const char* what) {
  if (r != CUDA_SUCCESS) {
    const char* msg = nullptr;
    cuGetErrorString(r, &msg);
    throw std::runtime_error(std::string("[flash_cce] ") + what + ": " +
                             (msg ? msg : "unknown CUDA error"));
  }
}

namespace {

// The fatbin installed beside the extension module (FLASH_CCE_FATBIN overrides).
std::string fatbin_path() {
  if (const char* env = std::getenv("FLASH_CCE_FATBIN")) {
    return env;
  }
  Dl_info info{};
  if (!dladdr(reinterpret_cast<void*>(&fatbin_path), &info) || !info.dli_fname) {
    throw std::runtime_error("[flash_cce] cannot locate the extension module");
  }
  std::string so = info.dli_fname;
  return so.substr(0, so.find_last_of('/') + 1) + "flash_cce_kernels.fatbin";
}

class Kernels {
 public:
  CUfunction get(const std::string& name, int ordinal, int smem) {
    std::lock_guard<std::mutex> lock(mutex_);
    ensure_loaded(ordinal);
    auto it = fns_.find(name);
    if (it != fns_.end()) {
      return it->second;
    }
    CUfunction fn;
    check(cuModuleGetFunction(&fn, module_, name.c_str()), ("kernel " + name).c_str());
    check(cuFuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem),
          "shared memory size");
    fns_.emplace(name, fn);
    return fn;
  }

  const Image& image(int ordinal) {
    std::lock_guard<std::mutex> lock(mutex_);
    ensure_loaded(ordinal);
    return image_info_;
  }

 private:
  void ensure_loaded(int ordinal) {
    if (!module_) {
      ordinal_ = ordinal;
      load();
      describe();
    }
  }

  int read_global(const char* name) {
    CUdeviceptr ptr;
    size_t bytes = 0;
    check(cuModuleGetGlobal(&ptr, &bytes, module_, name), name);
    int v = 0;
    check(cuMemcpyDtoH(&v, ptr, sizeof(v)), name);
    return v;
  }

  // A SASS image runs as compiled (binary == arch / 10); PTX is compiled by
  // the driver for the GPU at hand, so its binary version is the GPU's.
  void describe() {
    Image& im = image_info_;
    im.arch = read_global("fcce_image_arch");
    im.wgmma = read_global("fcce_image_wgmma") != 0;
    CUfunction fn;
    check(cuModuleGetFunction(&fn, module_, "fcce_zero"), "kernel fcce_zero");
    check(cuFuncGetAttribute(&im.binary, CU_FUNC_ATTRIBUTE_BINARY_VERSION, fn),
          "binary version");
    CUdevice dev;
    int major = 0, minor = 0;
    check(cuDeviceGet(&dev, ordinal_), "cuDeviceGet");
    check(cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev),
          "compute capability");
    check(cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev),
          "compute capability");
    im.device = major * 10 + minor;
    im.jit = im.binary * 10 != im.arch;
  }

  void load() {
    const std::string path = fatbin_path();
    std::ifstream in(path, std::ios::binary);
    if (!in) {
      throw std::runtime_error("[flash_cce] missing CUDA kernels: " + path);
    }
    image_.assign(std::istreambuf_iterator<char>(in), {});
    // MLX has made its device current through the runtime; make sure the
    // driver sees that primary context on this thread too.
    CUcontext ctx = nullptr;
    check(cuCtxGetCurrent(&ctx), "cuCtxGetCurrent");
    if (!ctx) {
      CUdevice dev;
      check(cuInit(0), "cuInit");
      check(cuDeviceGet(&dev, ordinal_), "cuDeviceGet");
      check(cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
      check(cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
    }
    check(cuModuleLoadData(&module_, image_.data()), ("loading " + path).c_str());
  }

  std::mutex mutex_;
  std::string image_;
  CUmodule module_ = nullptr;
  Image image_info_;
  int ordinal_ = 0;
  std::unordered_map<std::string, CUfunction> fns_;
};

Kernels& kernels() {
  static Kernels k;
  return k;
}

} // namespace

CUfunction kernel_function(const std::string& name, int ordinal, int smem) {
  return kernels().get(name, ordinal, smem);
}

const Image& loaded_image(int ordinal) {
  return kernels().image(ordinal);
}

DeviceInfo device_info(int ordinal) {
  static std::mutex mutex;
  static std::unordered_map<int, DeviceInfo> infos;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = infos.find(ordinal);
  if (it == infos.end()) {
    CUdevice dev;
    int sms = 0, l2 = 0;
    check(cuInit(0), "cuInit");
    check(cuDeviceGet(&dev, ordinal), "cuDeviceGet");
    check(cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev),
          "multiprocessor count");
    check(cuDeviceGetAttribute(&l2, CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, dev), "L2 cache size");
    it = infos.emplace(ordinal, DeviceInfo{sms, l2}).first;
  }
  return it->second;
}

std::string kernel_image(int ordinal) {
  const Image& im = kernels().image(ordinal);
  auto sm = [](int v) { return std::to_string(v); };
  std::string out = "device sm_" + sm(im.device) + ", image ";
  out += im.jit ? "compute_" + sm(im.arch / 10) + " PTX, JIT-compiled to sm_" + sm(im.binary)
                : "sm_" + sm(im.binary) + (im.wgmma ? "a" : "") + " SASS";
  out += im.wgmma ? ", Hopper kernels" : ", portable kernels";
  return out;
}

} // namespace flash_cce::cuda
