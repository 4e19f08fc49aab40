// deepep::cartpole_rollout: schema, input checks and the CPU kernel (the stages are in cartpole_rollout.h).
//
// The CPU kernel runs each block's stages for every thread index in turn, the order the CUDA kernel's
// barriers allow; blocks are independent and run in parallel.
#include "cartpole_rollout.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

namespace deepep::rollout {

namespace {

constexpr const char* kOp = "deepep::cartpole_rollout";
constexpr const char* kWeightNames[] = {"policy_w1t", "policy_b1", "policy_w2", "policy_b2", "value_w1t",
                                        "value_b1",   "embedding", "value_w2",  "value_b2",  "gru_wiht",
                                        "gru_bih",    "gru_whht",  "gru_bhh"};
constexpr size_t kWeights = sizeof(kWeightNames) / sizeof(kWeightNames[0]);

void check_shape(const at::Tensor& value, const char* name, at::IntArrayRef shape) {
  TORCH_CHECK(value.sizes() == shape, kOp, ": ", name, " must have shape ", shape, ", got ", value.sizes());
}

}  // namespace

void check_cartpole_rollout_inputs(const at::Tensor& state, const at::Tensor& episode_return,
                                   const at::Tensor& episode_length, const at::Tensor& hidden,
                                   const at::Tensor& uniforms, const at::Tensor& noise, at::TensorList weights,
                                   int64_t rows_per_block) {
  TORCH_CHECK(hidden.dim() == 2, kOp, ": hidden must be 2-D [B, H], got shape ", hidden.sizes());
  TORCH_CHECK(hidden.scalar_type() == at::kFloat || hidden.scalar_type() == at::kDouble, kOp,
              ": hidden must be float32 or float64, got ", hidden.scalar_type());
  TORCH_CHECK(weights.size() == kWeights, kOp, ": weights must hold ", kWeights, " tensors, got ", weights.size());
  TORCH_CHECK(rows_per_block >= 1 && rows_per_block <= kMaxRows, kOp, ": rows_per_block must be in [1, ", kMaxRows,
              "], got ", rows_per_block);
  const int64_t batch = hidden.size(0), size = hidden.size(1);
  TORCH_CHECK(uniforms.dim() == 2 && uniforms.size(1) == batch, kOp, ": uniforms must be [T, ", batch, "], got ",
              uniforms.sizes());
  const int64_t steps = uniforms.size(0);
  check_shape(state, "state", {batch, kObs});
  check_shape(episode_return, "episode_return", {batch});
  check_shape(episode_length, "episode_length", {batch});
  check_shape(noise, "noise", {steps, batch, kObs});
  const int64_t policy_hidden = weights[1].dim() == 1 ? weights[1].size(0) : -1;
  const int64_t value_hidden = weights[5].dim() == 1 ? weights[5].size(0) : -1;
  TORCH_CHECK(policy_hidden >= 1, kOp, ": policy_b1 must be 1-D [Hp], got ", weights[1].sizes());
  TORCH_CHECK(value_hidden >= 1, kOp, ": value_b1 must be 1-D [Hv], got ", weights[5].sizes());
  const int64_t policy_in = weights[0].dim() == 2 ? weights[0].size(0) : -1;
  TORCH_CHECK(policy_in == kObs || policy_in == kObs + size, kOp, ": policy_w1t must be [", kObs, " or ", kObs + size,
              ", ", policy_hidden, "], got ", weights[0].sizes());
  const std::vector<std::vector<int64_t>> shapes = {
      {policy_in, policy_hidden}, {policy_hidden},      {kActions, policy_hidden}, {kActions},
      {kObs + size, value_hidden}, {value_hidden},      {kActions, value_hidden},  {value_hidden},
      {1},                         {kFeedback, 3 * size}, {3 * size},              {size, 3 * size},
      {3 * size}};
  for (size_t i = 0; i < kWeights; ++i) check_shape(weights[i], kWeightNames[i], shapes[i]);
  std::vector<std::pair<const at::Tensor*, const char*>> all = {
      {&state, "state"}, {&episode_return, "episode_return"}, {&episode_length, "episode_length"},
      {&uniforms, "uniforms"}, {&noise, "noise"}};
  for (size_t i = 0; i < kWeights; ++i) all.emplace_back(&weights[i], kWeightNames[i]);
  for (const auto& [tensor, name] : all) {
    TORCH_CHECK(tensor->scalar_type() == hidden.scalar_type() && tensor->device() == hidden.device(), kOp, ": ", name,
                " must have hidden's dtype ", hidden.scalar_type(), " and device ", hidden.device(), ", got ",
                tensor->scalar_type(), " on ", tensor->device());
  }
}

namespace {

// Contiguous copies of the inputs, the outputs and the Args pointing at them.
struct Prepared {
  std::vector<at::Tensor> keep;  // contiguous inputs, alive while the kernel runs
  at::Tensor observations, feedback, states, actions, rewards, dones, terminateds, returns, next_state,
      next_episode_return, next_episode_length;
};

template <typename scalar_t>
Args<scalar_t> make_args(Prepared& p, int64_t max_episode_steps, double logit_bound) {
  const at::Tensor& hidden = p.keep[3];
  Args<scalar_t> a{};
  a.batch = hidden.size(0);
  a.hidden = hidden.size(1);
  a.steps = p.keep[4].size(0);
  a.policy_in = p.keep[6].size(0);
  a.policy_hidden = p.keep[7].size(0);
  a.value_hidden = p.keep[11].size(0);
  a.max_episode_steps = max_episode_steps;
  a.logit_bound = static_cast<scalar_t>(logit_bound);
  const scalar_t* in[19];
  for (int i = 0; i < 19; ++i) in[i] = p.keep[i].data_ptr<scalar_t>();
  a.state = in[0];
  a.episode_return = in[1];
  a.episode_length = in[2];
  a.h0 = in[3];
  a.uniforms = in[4];
  a.noise = in[5];
  a.policy_w1t = in[6];
  a.policy_b1 = in[7];
  a.policy_w2 = in[8];
  a.policy_b2 = in[9];
  a.value_w1t = in[10];
  a.value_b1 = in[11];
  a.embedding = in[12];
  a.value_w2 = in[13];
  a.value_b2 = in[14];
  a.gru_wiht = in[15];
  a.gru_bih = in[16];
  a.gru_whht = in[17];
  a.gru_bhh = in[18];
  a.observations = p.observations.data_ptr<scalar_t>();
  a.feedback = p.feedback.data_ptr<scalar_t>();
  a.states = p.states.data_ptr<scalar_t>();
  a.actions = p.actions.data_ptr<int64_t>();
  a.rewards = p.rewards.data_ptr<scalar_t>();
  a.dones = p.dones.data_ptr<bool>();
  a.terminateds = p.terminateds.data_ptr<bool>();
  a.returns = p.returns.data_ptr<scalar_t>();
  a.next_state = p.next_state.data_ptr<scalar_t>();
  a.next_episode_return = p.next_episode_return.data_ptr<scalar_t>();
  a.next_episode_length = p.next_episode_length.data_ptr<scalar_t>();
  return a;
}

}  // namespace

Outputs cartpole_rollout_impl(const at::Tensor& state, const at::Tensor& episode_return,
                              const at::Tensor& episode_length, const at::Tensor& hidden, const at::Tensor& uniforms,
                              const at::Tensor& noise, at::TensorList weights, double logit_bound,
                              int64_t max_episode_steps, int64_t rows_per_block, const Runner<float>& run_float,
                              const Runner<double>& run_double) {
  check_cartpole_rollout_inputs(state, episode_return, episode_length, hidden, uniforms, noise, weights,
                                rows_per_block);
  TORCH_CHECK(max_episode_steps >= 1, kOp, ": max_episode_steps must be >= 1, got ", max_episode_steps);
  Prepared p;
  for (const at::Tensor* t : {&state, &episode_return, &episode_length, &hidden, &uniforms, &noise}) {
    p.keep.push_back(t->contiguous());
  }
  for (const at::Tensor& w : weights) p.keep.push_back(w.contiguous());
  const int64_t steps = uniforms.size(0), batch = hidden.size(0), size = hidden.size(1);
  const auto opts = hidden.options();
  p.observations = at::empty({steps, batch, kObs}, opts);
  p.feedback = at::empty({steps, batch, kFeedback}, opts);
  p.states = at::empty({steps, batch, size}, opts);
  p.actions = at::empty({steps, batch}, opts.dtype(at::kLong));
  p.rewards = at::empty({steps, batch}, opts);
  p.dones = at::empty({steps, batch}, opts.dtype(at::kBool));
  p.terminateds = at::empty({steps, batch}, opts.dtype(at::kBool));
  p.returns = at::empty({steps, batch}, opts);
  p.next_state = at::empty({batch, kObs}, opts);
  p.next_episode_return = at::empty({batch}, opts);
  p.next_episode_length = at::empty({batch}, opts);
  if (batch > 0 && steps > 0) {
    if (hidden.scalar_type() == at::kFloat) {
      run_float(make_args<float>(p, max_episode_steps, logit_bound));
    } else {
      run_double(make_args<double>(p, max_episode_steps, logit_bound));
    }
  }
  return {p.observations, p.feedback, p.states, p.actions, p.rewards, p.dones, p.terminateds, p.returns,
          p.next_state, p.next_episode_return, p.next_episode_length};
}

namespace {

// Each block's stages for every thread index in turn; blocks in parallel.
template <typename scalar_t>
void run_cpu(const Args<scalar_t>& args, int64_t rows_per_block) {
  const int64_t blocks = (args.batch + rows_per_block - 1) / rows_per_block;
  const int64_t scalars = shared_scalars(kMaxRows, args.hidden, args.policy_hidden, args.value_hidden);
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<scalar_t> shared(static_cast<size_t>(scalars));
    for (int64_t block = begin; block < end; ++block) {
      const int64_t row0 = block * rows_per_block;
      const Block<scalar_t> blk(args, shared.data(), row0, std::min<int64_t>(rows_per_block, args.batch - row0));
      for (int tid = 0; tid < kThreads; ++tid) blk.load(tid, kThreads);
      for (int64_t t = 0; t < args.steps; ++t) {
        for (int tid = 0; tid < kThreads; ++tid) blk.hidden_layers(tid, kThreads);
        for (int tid = 0; tid < kThreads; ++tid) blk.head_partials(tid, kThreads);
        for (int tid = 0; tid < kThreads; ++tid) blk.head_finish(tid, kThreads);
        for (int tid = 0; tid < kThreads; ++tid) blk.act_and_env(t, tid, kThreads);
        for (int tid = 0; tid < kThreads; ++tid) blk.gru(t, tid, kThreads);
        for (int tid = 0; tid < kThreads; ++tid) blk.commit(tid, kThreads);
      }
      for (int tid = 0; tid < kThreads; ++tid) blk.store(tid, kThreads);
    }
  });
}

Outputs cartpole_rollout_cpu(const at::Tensor& state, const at::Tensor& episode_return,
                             const at::Tensor& episode_length, const at::Tensor& hidden, const at::Tensor& uniforms,
                             const at::Tensor& noise, at::TensorList weights, double logit_bound,
                             int64_t max_episode_steps, int64_t rows_per_block) {
  return cartpole_rollout_impl(
      state, episode_return, episode_length, hidden, uniforms, noise, weights, logit_bound, max_episode_steps,
      rows_per_block, [&](const Args<float>& args) { run_cpu(args, rows_per_block); },
      [&](const Args<double>& args) { run_cpu(args, rows_per_block); });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepep, m) {
  m.def(
      "cartpole_rollout(Tensor state, Tensor episode_return, Tensor episode_length, Tensor hidden, Tensor uniforms, "
      "Tensor noise, Tensor[] weights, float logit_bound, int max_episode_steps, int rows_per_block) -> (Tensor, "
      "Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  // The same rollout with each cluster of blocks keeping the weights on chip (CUDA, float32, compute capability
  // 9.0+; cuda/cartpole_rollout_clusters.cu): the same outputs, bit for bit. rows_per_cluster: environments per
  // cluster, 0 for the kernel's choice from cluster residency, else a multiple of 4 in [4, 64].
  m.def(
      "cartpole_rollout_clusters(Tensor state, Tensor episode_return, Tensor episode_length, Tensor hidden, "
      "Tensor uniforms, Tensor noise, Tensor[] weights, float logit_bound, int max_episode_steps, "
      "int rows_per_cluster=0) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, "
      "Tensor)");
}

TORCH_LIBRARY_IMPL(deepep, CPU, m) { m.impl("cartpole_rollout", &cartpole_rollout_cpu); }

}  // namespace deepep::rollout
