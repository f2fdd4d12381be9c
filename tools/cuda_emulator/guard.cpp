// A device guard for CUDA on a CPU-only torch build, so tensors that say `cuda:0` (the
// emulated device, tools/cuda_emulator/device.py) pass torch's device guards: one device,
// index 0, the default stream, nothing to switch. Registered only when torch has none.
#include <c10/core/impl/DeviceGuardImplInterface.h>
namespace {
using c10::Device; using c10::DeviceType; using c10::Stream;
struct EmuGuard final : c10::impl::DeviceGuardImplInterface {
  DeviceType type() const override { return DeviceType::CUDA; }
  Device exchangeDevice(Device) const override { return Device(DeviceType::CUDA, 0); }
  Device getDevice() const override { return Device(DeviceType::CUDA, 0); }
  void setDevice(Device) const override {}
  void uncheckedSetDevice(Device) const noexcept override {}
  Stream getStream(Device) const noexcept override { return Stream(Stream::DEFAULT, Device(DeviceType::CUDA, 0)); }
  Stream exchangeStream(Stream) const noexcept override { return Stream(Stream::DEFAULT, Device(DeviceType::CUDA, 0)); }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
};
}
extern "C" __attribute__((visibility("default"))) int gw_register_cuda_guard() {
  if (c10::impl::device_guard_impl_registry[static_cast<size_t>(DeviceType::CUDA)].load()) return 0;
  static c10::impl::DeviceGuardImplRegistrar reg(DeviceType::CUDA, new EmuGuard());
  return 1;
}
