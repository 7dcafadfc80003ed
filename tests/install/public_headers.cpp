// Compiled by the outside project of tests/install: every header a custom trainer includes, and
// a check that none of them pulled in a CUDA header.
#include "core/memory_pool.h"
#include "core/tensor.h"
#include "data/dataset.h"
#include "data/loader.h"
#include "ops/nn/model.h"
#include "ops/models/resnet.h"
#include "optim/optimizer.h"
#include "parallel/replica_group.h"
#include "train/config.h"
#include "train/model_io.h"
#include "train/replica_step.h"
#include "train/trainer.h"
#include "train/weights_interop.h"

#if defined(__CUDA_RUNTIME_H__) || defined(CUDART_VERSION) || defined(CUDNN_MAJOR) || defined(NCCL_MAJOR)
#error "a public replica header includes a CUDA header"
#endif
