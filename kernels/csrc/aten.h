// The parts of ATen the kernels use. <ATen/ATen.h> declares every operator: 3.5 s of
// each translation unit's ~10 s of headers on a 2-core machine, paid six times a build.
#pragma once

#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
