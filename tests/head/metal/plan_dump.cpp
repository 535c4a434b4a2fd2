// Prints csrc/metal/plan.h's launch plan as JSON, so that the Python emulation
// tests run exactly the launches the Metal host encodes.
//   plan_dump pass M H V h w sb out quantized bits group_size softcap ignore_index fused compute_dw
//             max_splits dw_slab_rows round_blocks round_m_tiles acc_registers stats
//   plan_dump --names
//   plan_dump --select SOURCE NAME...   (csrc/metal/kernel_source.h: SOURCE cut
//                                        down to the kernels NAME..., to stdout)
// pass: forward | backward | fused_dh; dtypes: f32 | f16 | bf16.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>

#include "metal/kernel_source.h"
#include "metal/plan.h"

using namespace flash_cce::metal;

namespace {

DType dtype(const char* s) {
  if (!std::strcmp(s, "f32")) return DType::f32;
  if (!std::strcmp(s, "f16")) return DType::f16;
  if (!std::strcmp(s, "bf16")) return DType::bf16;
  throw std::invalid_argument(std::string("unknown dtype ") + s);
}

Pass pass(const char* s) {
  if (!std::strcmp(s, "forward")) return Pass::forward;
  if (!std::strcmp(s, "backward")) return Pass::backward;
  if (!std::strcmp(s, "fused_dh")) return Pass::fused_dh;
  throw std::invalid_argument(std::string("unknown pass ") + s);
}

void print_params(const FcceParams& q) {
  std::printf(
      "{\"M\": %d, \"H\": %d, \"V\": %d, \"mode\": %d, \"bits\": %d, \"group_size\": %d, "
      "\"row_bytes\": %d, \"groups\": %d, \"sb_dtype\": %d, \"softcap\": %.9g, "
      "\"ignore_index\": %d, \"splits\": %d, \"blocks_per_split\": %d, \"m_tiles\": %d, "
      "\"m_tile_begin\": %d, \"split_begin\": %d, \"m_tile_count\": %d, \"block_begin\": %d, "
      "\"block_count\": %d, \"v_begin\": %d, \"v_count\": %d, \"acc_row0\": %d, "
      "\"count\": %d}",
      q.M, q.H, q.V, q.mode, q.bits, q.group_size, q.row_bytes, q.groups, q.sb_dtype,
      q.softcap, q.ignore_index, q.splits, q.blocks_per_split, q.m_tiles, q.m_tile_begin,
      q.split_begin, q.m_tile_count, q.block_begin, q.block_count, q.v_begin, q.v_count, q.acc_row0, q.count);
}

void print_plan(const Plan& plan) {
  std::printf("{\"params_bytes\": %zu, \"scratch\": [", sizeof(FcceParams));
  for (size_t i = 0; i < plan.scratch.size(); ++i) {
    std::printf("%s{\"role\": \"%s\", \"bytes\": %zu}", i ? ", " : "",
                role_name(plan.scratch[i].role), plan.scratch[i].bytes);
  }
  std::printf("], \"launches\": [");
  for (size_t i = 0; i < plan.launches.size(); ++i) {
    const Launch& l = plan.launches[i];
    std::printf("%s{\"kernel\": \"%s\", \"grid\": [%u, %u, %u], \"threads\": [%u, %u, %u], "
                "\"threadgroup_bytes\": %zu, \"params_index\": %d, \"buffers\": [",
                i ? ", " : "", l.kernel, l.grid[0], l.grid[1], l.grid[2], l.threads[0],
                l.threads[1], l.threads[2], l.threadgroup_bytes, l.params_index);
    for (size_t j = 0; j < l.buffers.size(); ++j) {
      std::printf("%s[%d, \"%s\"]", j ? ", " : "", l.buffers[j].index,
                  role_name(l.buffers[j].role));
    }
    std::printf("], \"params\": ");
    print_params(l.params);
    std::printf("}");
  }
  std::printf("]}\n");
}

} // namespace

int main(int argc, char** argv) {
  try {
    if (argc == 2 && !std::strcmp(argv[1], "--names")) {
      for (const auto& n : kernel_names()) std::printf("%s\n", n.c_str());
      return 0;
    }
    if (argc >= 3 && !std::strcmp(argv[1], "--select")) {
      std::ifstream in(argv[2], std::ios::binary);
      std::stringstream text;
      text << in.rdbuf();
      const std::set<std::string> names(argv + 3, argv + argc);
      std::fputs(select_kernels(text.str(), names).c_str(), stdout);
      return 0;
    }
    if (argc != 22) {
      std::fprintf(stderr, "usage: see the header of plan_dump.cpp\n");
      return 2;
    }
    Problem p;
    p.pass = pass(argv[1]);
    p.M = std::atoll(argv[2]);
    p.H = std::atoll(argv[3]);
    p.V = std::atoll(argv[4]);
    p.h = dtype(argv[5]);
    p.w = dtype(argv[6]);
    p.sb = dtype(argv[7]);
    p.out = dtype(argv[8]);
    p.quantized = std::atoi(argv[9]) != 0;
    p.bits = std::atoi(argv[10]);
    p.group_size = std::atoi(argv[11]);
    p.softcap = static_cast<float>(std::atof(argv[12]));
    p.ignore_index = std::atoi(argv[13]);
    p.fused = std::atoi(argv[14]) != 0;
    p.compute_dw = std::atoi(argv[15]) != 0;
    p.max_splits = std::atoi(argv[16]);
    p.dw_slab_rows = std::atoi(argv[17]);
    p.round_blocks = std::atoi(argv[18]);
    p.round_m_tiles = std::atoi(argv[19]);
    p.acc_registers = std::atoi(argv[20]);
    p.stats = std::atoi(argv[21]) != 0;
    print_plan(make_plan(p));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
