// Placeholder until the fused CPU kernel lands (issue 27): refuses clearly.
#include <stdexcept>

#include "kernels.h"

namespace zk {
void adamw_compressed_cpu(const CompressedArgs&, const AdamScalars&) {
  throw std::runtime_error("adamw_compressed_cpu: not built yet");
}
}  // namespace zk
