// deepep::cartpole_rollout: T timesteps of the DeepEP agent on CartPole, without gradient, in one launch.
//
// Every quantity of a timestep belongs to one environment (row b): the policy and the value head read
// [obs_b; h_b], the action is sampled from row b's uniform, CartPole steps row b alone and the GRU cell
// updates h_b. So a block owns a few rows for the whole rollout and needs no grid-wide synchronisation:
// it keeps its rows' observations, recurrent states and CartPole states in shared memory, reads the
// weights from L2 (each weight load serves every row of the block), and runs per timestep
//
//   hidden_layers   p1 = tanh(W_p1 [obs; h] + b_p1)  and  z = W_v1 [obs; h] + b_v1   (thread j: unit j)
//   head_partials   32 partial sums per (row, action) of the logits  w_p2 . p1  and of  w2 . tanh(z + E[a])
//   head_finish     the logits (bounded: c tanh(l / c)) and Q: the 32 partials summed in lane order
//   act_and_env     softmax, inverse-CDF sample, one-hot, v = Q[a], feedback [obs; onehot; v], CartPole's
//                   Euler step, auto-reset from the row's noise, the episode accumulators  (thread r: row r)
//   gru             r, z, n gates and h' = (1 - z) n + z h, masked where the episode ended  (thread j: unit j)
//   commit          the next observations and states into the block's inputs of the next timestep
//
// separated by block barriers. Each sum runs in a fixed order that depends on the sizes alone (no
// atomics, nothing depends on timing), so the rollout is bitwise reproducible. The CPU kernel runs the same
// stage functions for every thread index of a block in turn, so both devices share the element code
// (CUDA contracts a * b + c into fused multiply-adds and has its own tanh/exp/sin/cos: the devices agree to
// rounding, each repeats bitwise). The math is that of DeepEPAgent.step and BatchedCartPole.step_with_noise;
// the module's op-by-op timestep is the reference.
#pragma once

#include <ATen/ATen.h>
#include <c10/macros/Macros.h>

#include <math.h>

#include <cstdint>
#include <functional>
#include <tuple>

// Loops over a block's rows run to kMaxRows with a guard, unrolled on the device so the per-row accumulators
// stay in registers. The loops over a layer's inputs are unrolled 8 times on the device: a thread then has 8
// (GRU: 24) weight loads in flight instead of one, since each timestep is bound by the latency of L2 loads.
#if defined(__CUDA_ARCH__)
#define DEEPEP_ROWS_UNROLL _Pragma("unroll")
#define DEEPEP_INPUTS_UNROLL _Pragma("unroll 8")
#else
#define DEEPEP_ROWS_UNROLL
#define DEEPEP_INPUTS_UNROLL
#endif

namespace deepep::rollout {

constexpr int kThreads = 256;       // threads of a block (CUDA), thread indices a CPU block runs through
constexpr int kMaxRows = 8;         // rows (environments) per block
constexpr int kLanes = 32;          // partial sums per head output
constexpr int kObs = 4;             // CartPole: x, x_dot, theta, theta_dot
constexpr int kActions = 2;         // CartPole: push left, push right
constexpr int kFeedback = kObs + kActions + 1;  // [obs; onehot(a); v]

// CartPole's constants (deepep_lightning/deepep/envs/cartpole.py, gymnasium's values).
constexpr double kGravity = 9.8;
constexpr double kMassPole = 0.1;
constexpr double kTotalMass = 1.0 + kMassPole;
constexpr double kHalfPoleLength = 0.5;
constexpr double kPoleMassLength = kMassPole * kHalfPoleLength;
constexpr double kForceMag = 10.0;
constexpr double kTau = 0.02;
constexpr double kThetaThreshold = 12 * 2 * 3.141592653589793 / 360;
constexpr double kXThreshold = 2.4;
constexpr double kResetLow = -0.05;
constexpr double kResetHigh = 0.05;

C10_HOST_DEVICE inline float r_tanh(float x) { return tanhf(x); }
C10_HOST_DEVICE inline double r_tanh(double x) { return tanh(x); }
C10_HOST_DEVICE inline float r_exp(float x) { return expf(x); }
C10_HOST_DEVICE inline double r_exp(double x) { return exp(x); }
C10_HOST_DEVICE inline float r_sin(float x) { return sinf(x); }
C10_HOST_DEVICE inline double r_sin(double x) { return sin(x); }
C10_HOST_DEVICE inline float r_cos(float x) { return cosf(x); }
C10_HOST_DEVICE inline double r_cos(double x) { return cos(x); }
template <typename scalar_t>
C10_HOST_DEVICE inline scalar_t r_sigmoid(scalar_t x) {
  return scalar_t(1) / (scalar_t(1) + r_exp(-x));
}

// Pointers and sizes of one rollout; weights transposed to [in, out] so that thread j's loads of unit j are
// consecutive across a warp. Outputs are [T, B, ...] contiguous.
template <typename scalar_t>
struct Args {
  int64_t batch, steps, hidden, policy_in, policy_hidden, value_hidden, max_episode_steps;
  scalar_t logit_bound;  // <= 0: unbounded logits
  const scalar_t* state;           // [B, 4]
  const scalar_t* episode_return;  // [B]
  const scalar_t* episode_length;  // [B]
  const scalar_t* h0;              // [B, H]
  const scalar_t* uniforms;        // [T, B]
  const scalar_t* noise;           // [T, B, 4]
  const scalar_t* policy_w1t;      // [policy_in, Hp]  (policy_in: 4 + H, or 4 when the policy reads obs alone)
  const scalar_t* policy_b1;       // [Hp]
  const scalar_t* policy_w2;       // [A, Hp]
  const scalar_t* policy_b2;       // [A]
  const scalar_t* value_w1t;       // [4 + H, Hv]
  const scalar_t* value_b1;        // [Hv]
  const scalar_t* embedding;       // [A, Hv]
  const scalar_t* value_w2;        // [Hv]
  const scalar_t* value_b2;        // [1]
  const scalar_t* gru_wiht;        // [7, 3H]
  const scalar_t* gru_bih;         // [3H]
  const scalar_t* gru_whht;        // [H, 3H]
  const scalar_t* gru_bhh;         // [3H]
  scalar_t* observations;          // [T, B, 4]  obs_t
  scalar_t* feedback;              // [T, B, 7]  [obs_t; onehot(a_t); v_t]
  scalar_t* states;                // [T, B, H]  h_{t+1}, zero where the episode ended at t
  int64_t* actions;                // [T, B]
  scalar_t* rewards;               // [T, B]
  bool* dones;                     // [T, B]
  bool* terminateds;               // [T, B]
  scalar_t* returns;               // [T, B]  the finished episode's return where done, else 0
  scalar_t* next_state;            // [B, 4]
  scalar_t* next_episode_return;   // [B]
  scalar_t* next_episode_length;   // [B]
};

// Scalars of a block's shared memory for `rows` rows (the same layout on both devices).
inline int64_t shared_scalars(int64_t rows, int64_t hidden, int64_t policy_hidden, int64_t value_hidden) {
  return rows * (kObs + hidden)           // inputs [obs; h]
         + rows * policy_hidden           // p1
         + rows * value_hidden            // z
         + 2 * rows * kActions * kLanes   // partial sums of the logits and of Q
         + 2 * rows * kActions            // logits, Q
         + rows * kFeedback               // feedback
         + rows                           // keep = 1 - done
         + rows * hidden                  // next states
         + rows * (kObs + 2);             // CartPole state, episode return and length
}

// The head's output from its 32 lane partials (summed in lane order): the bounded logit of an action, or its Q.
template <typename scalar_t>
C10_HOST_DEVICE inline scalar_t finish_logit(const Args<scalar_t>& a, scalar_t sum, int64_t c) {
  scalar_t logit = sum + a.policy_b2[c];
  if (a.logit_bound > scalar_t(0)) logit = a.logit_bound * r_tanh(logit / a.logit_bound);
  return logit;
}

// One row's timestep t after the head: the action sampled from `logits` (Q: `logits + kActions`), the feedback
// [obs; onehot(a); Q[a]] into `f`, CartPole's Euler step of `s` (its state, episode return and length; reset
// where done) from the observation `obs`, and `keep` = 1 - done. With `publish`, the row's outputs of timestep t
// go to the op's tensors (b: the row's environment).
template <typename scalar_t>
C10_HOST_DEVICE inline void act_and_env_row(const Args<scalar_t>& a, int64_t t, int64_t b, const scalar_t* logits,
                                            const scalar_t* obs, scalar_t* f, scalar_t* s, scalar_t* keep,
                                            bool publish) {
  const int64_t tb = t * a.batch + b;
  const scalar_t* q = logits + kActions;
  // torch.softmax(logits).cumsum() < u, counted and clamped (sample_categorical)
  scalar_t top = logits[0];
  for (int c = 1; c < kActions; ++c) top = logits[c] > top ? logits[c] : top;
  scalar_t e[kActions], total = scalar_t(0);
  for (int c = 0; c < kActions; ++c) {
    e[c] = r_exp(logits[c] - top);
    total += e[c];
  }
  const scalar_t u = a.uniforms[tb];
  scalar_t cdf = scalar_t(0);
  int64_t action = 0;
  for (int c = 0; c < kActions; ++c) {
    cdf += e[c] / total;
    action += cdf < u ? 1 : 0;
  }
  action = action < kActions - 1 ? action : kActions - 1;
  // the feedback [obs; onehot(a); Q[a]] and obs_t
  for (int k = 0; k < kObs; ++k) f[k] = obs[k];
  for (int c = 0; c < kActions; ++c) f[kObs + c] = c == action ? scalar_t(1) : scalar_t(0);
  f[kObs + kActions] = q[action];
  // CartPole's Euler step (BatchedCartPole.step_with_noise), in the same operation order
  const scalar_t x = s[0], x_dot = s[1], theta = s[2], theta_dot = s[3];
  const scalar_t force = action == 1 ? scalar_t(kForceMag) : scalar_t(-kForceMag);
  const scalar_t cos_t = r_cos(theta), sin_t = r_sin(theta);
  const scalar_t temp = (force + scalar_t(kPoleMassLength) * (theta_dot * theta_dot) * sin_t) / scalar_t(kTotalMass);
  const scalar_t theta_acc =
      (scalar_t(kGravity) * sin_t - cos_t * temp) /
      (scalar_t(kHalfPoleLength) *
       (scalar_t(4.0 / 3.0) - scalar_t(kMassPole) * (cos_t * cos_t) / scalar_t(kTotalMass)));
  const scalar_t x_acc = temp - scalar_t(kPoleMassLength) * theta_acc * cos_t / scalar_t(kTotalMass);
  const scalar_t tau = scalar_t(kTau);
  const scalar_t next[kObs] = {x + tau * x_dot, x_dot + tau * x_acc, theta + tau * theta_dot,
                               theta_dot + tau * theta_acc};
  const scalar_t xt = scalar_t(kXThreshold), tt = scalar_t(kThetaThreshold);
  const bool terminated = next[0] < -xt || next[0] > xt || next[2] < -tt || next[2] > tt;
  const bool truncated = s[kObs + 1] + scalar_t(1) >= scalar_t(a.max_episode_steps);
  const bool done = terminated || truncated;
  const scalar_t* noise = a.noise + tb * kObs;
  for (int k = 0; k < kObs; ++k) {
    s[k] = done ? scalar_t(kResetLow) + scalar_t(kResetHigh - kResetLow) * noise[k] : next[k];
  }
  // BatchedEnv._finish: reward 1 on every step, the finished episode's return where done
  const scalar_t reward = scalar_t(1);
  s[kObs] += reward;
  s[kObs + 1] += scalar_t(1);
  if (publish) {
    for (int k = 0; k < kObs; ++k) {
      a.observations[tb * kObs + k] = f[k];
      a.feedback[tb * kFeedback + k] = f[k];
    }
    for (int c = 0; c < kActions + 1; ++c) a.feedback[tb * kFeedback + kObs + c] = f[kObs + c];
    a.actions[tb] = action;
    a.rewards[tb] = reward;
    a.dones[tb] = done;
    a.terminateds[tb] = terminated;
    a.returns[tb] = done ? s[kObs] : scalar_t(0);
  }
  const scalar_t kept = done ? scalar_t(0) : scalar_t(1);
  s[kObs] *= kept;
  s[kObs + 1] *= kept;
  *keep = kept;
}

// Unit j of one row's GRU cell (gates [r, z, n] as torch.nn.GRUCell) from its input sums gi and hidden sums gh:
// h_{t+1} = keep * ((1 - z) n + z h).
template <typename scalar_t>
C10_HOST_DEVICE inline scalar_t gru_unit(const Args<scalar_t>& a, int64_t j, const scalar_t gi[3],
                                         const scalar_t gh[3], scalar_t h, scalar_t keep) {
  const int64_t size = a.hidden;
  const scalar_t rg = r_sigmoid(gi[0] + a.gru_bih[j] + (gh[0] + a.gru_bhh[j]));
  const scalar_t zg = r_sigmoid(gi[1] + a.gru_bih[size + j] + (gh[1] + a.gru_bhh[size + j]));
  const scalar_t n = r_tanh(gi[2] + a.gru_bih[2 * size + j] + rg * (gh[2] + a.gru_bhh[2 * size + j]));
  return ((scalar_t(1) - zg) * n + zg * h) * keep;
}

// The op's last outputs for `count` rows from `row0`: each row's CartPole state, episode return and length from
// `env` ([count][kObs + 2]) after the last timestep. Thread `tid` of `threads` stores every threads-th value.
template <typename scalar_t>
C10_HOST_DEVICE inline void store_env(const Args<scalar_t>& a, int64_t row0, int64_t count, const scalar_t* env,
                                      int tid, int threads) {
  for (int64_t i = tid; i < count * (kObs + 2); i += threads) {
    const int64_t r = i / (kObs + 2), k = i - r * (kObs + 2), b = row0 + r;
    const scalar_t v = env[i];
    if (k < kObs) {
      a.next_state[b * kObs + k] = v;
    } else if (k == kObs) {
      a.next_episode_return[b] = v;
    } else {
      a.next_episode_length[b] = v;
    }
  }
}

// One block of the rollout: `count` rows from `row0`, its shared memory at `shared`. Each stage is called
// for every thread index `tid` in [0, threads) between barriers.
template <typename scalar_t>
struct Block {
  const Args<scalar_t>& a;
  int64_t row0, count;
  scalar_t *inputs, *p1, *z, *partial, *head, *fb, *keep, *next_h, *env;

  C10_HOST_DEVICE Block(const Args<scalar_t>& args, scalar_t* shared, int64_t first_row, int64_t rows)
      : a(args), row0(first_row), count(rows) {
    const int64_t r = kMaxRows;  // the layout is sized for kMaxRows; `count` rows of it are used
    inputs = shared;
    p1 = inputs + r * (kObs + a.hidden);
    z = p1 + r * a.policy_hidden;
    partial = z + r * a.value_hidden;
    head = partial + 2 * r * kActions * kLanes;
    fb = head + 2 * r * kActions;
    keep = fb + r * kFeedback;
    next_h = keep + r;
    env = next_h + r * a.hidden;
  }

  C10_HOST_DEVICE scalar_t* row_inputs(int64_t r) const { return inputs + r * (kObs + a.hidden); }
  C10_HOST_DEVICE scalar_t* row_env(int64_t r) const { return env + r * (kObs + 2); }

  // The rows' CartPole states, episode accumulators and recurrent states into shared memory.
  C10_HOST_DEVICE void load(int tid, int threads) const {
    const int64_t width = kObs + a.hidden;
    for (int64_t i = tid; i < count * width; i += threads) {
      const int64_t r = i / width, k = i - r * width, b = row0 + r;
      row_inputs(r)[k] = k < kObs ? a.state[b * kObs + k] : a.h0[b * a.hidden + (k - kObs)];
    }
    for (int64_t i = tid; i < count * (kObs + 2); i += threads) {
      const int64_t r = i / (kObs + 2), k = i - r * (kObs + 2), b = row0 + r;
      row_env(r)[k] = k < kObs ? a.state[b * kObs + k] : (k == kObs ? a.episode_return[b] : a.episode_length[b]);
    }
  }

  // acc[r] = sum over k < in of x_r[k] * wt[k, j] (x_r: row r's inputs [obs; h]), k in order; wt is [in, out].
  C10_HOST_DEVICE void unit_sums(const scalar_t* wt, int64_t in, int64_t out, int64_t j, scalar_t* acc) const {
    const int64_t width = kObs + a.hidden;
    DEEPEP_ROWS_UNROLL
    for (int r = 0; r < kMaxRows; ++r) acc[r] = scalar_t(0);
    DEEPEP_INPUTS_UNROLL
    for (int64_t k = 0; k < in; ++k) {
      const scalar_t w = wt[k * out + j];
      DEEPEP_ROWS_UNROLL
      for (int r = 0; r < kMaxRows; ++r) {
        if (r < count) acc[r] += inputs[r * width + k] * w;
      }
    }
  }

  // p1 = tanh(W_p1 x_p + b_p1), z = W_v1 x + b_v1: thread j computes unit j of every row, each weight loaded once.
  C10_HOST_DEVICE void hidden_layers(int tid, int threads) const {
    scalar_t acc[kMaxRows];
    for (int64_t j = tid; j < a.policy_hidden; j += threads) {
      unit_sums(a.policy_w1t, a.policy_in, a.policy_hidden, j, acc);
      DEEPEP_ROWS_UNROLL
      for (int r = 0; r < kMaxRows; ++r) {
        if (r < count) p1[r * a.policy_hidden + j] = r_tanh(acc[r] + a.policy_b1[j]);
      }
    }
    for (int64_t j = tid; j < a.value_hidden; j += threads) {
      unit_sums(a.value_w1t, kObs + a.hidden, a.value_hidden, j, acc);
      DEEPEP_ROWS_UNROLL
      for (int r = 0; r < kMaxRows; ++r) {
        if (r < count) z[r * a.value_hidden + j] = acc[r] + a.value_b1[j];
      }
    }
  }

  // Output o in [0, 2 * count * A): the logit (o < count * A) or the Q of row r, action c. Lane l sums the
  // terms j = l, l + 32, ... in order.
  C10_HOST_DEVICE void head_partials(int tid, int threads) const {
    const int64_t outputs = 2 * count * kActions;
    for (int64_t i = tid; i < outputs * kLanes; i += threads) {
      const int64_t o = i / kLanes, lane = i - o * kLanes;
      const bool is_q = o >= count * kActions;
      const int64_t ra = is_q ? o - count * kActions : o, r = ra / kActions, c = ra - r * kActions;
      scalar_t acc = scalar_t(0);
      if (!is_q) {
        const scalar_t* w = a.policy_w2 + c * a.policy_hidden;
        const scalar_t* x = p1 + r * a.policy_hidden;
        for (int64_t j = lane; j < a.policy_hidden; j += kLanes) acc += x[j] * w[j];
      } else {
        const scalar_t* e = a.embedding + c * a.value_hidden;
        const scalar_t* x = z + r * a.value_hidden;
        for (int64_t j = lane; j < a.value_hidden; j += kLanes) acc += a.value_w2[j] * r_tanh(x[j] + e[j]);
      }
      partial[o * kLanes + lane] = acc;
    }
  }

  // head[r * 2A + c] = logit of action c, head[r * 2A + A + c] = its Q: the partials summed in lane order.
  C10_HOST_DEVICE void head_finish(int tid, int threads) const {
    const int64_t outputs = 2 * count * kActions;
    for (int64_t o = tid; o < outputs; o += threads) {
      const bool is_q = o >= count * kActions;
      const int64_t ra = is_q ? o - count * kActions : o, r = ra / kActions, c = ra - r * kActions;
      scalar_t sum = scalar_t(0);
      for (int64_t lane = 0; lane < kLanes; ++lane) sum += partial[o * kLanes + lane];
      if (is_q) {
        head[r * 2 * kActions + kActions + c] = sum + a.value_b2[0];
      } else {
        head[r * 2 * kActions + c] = finish_logit(a, sum, c);
      }
    }
  }

  // Thread r: row r's action, feedback, CartPole step and outputs of timestep t.
  C10_HOST_DEVICE void act_and_env(int64_t t, int tid, int threads) const {
    for (int64_t r = tid; r < count; r += threads) {
      act_and_env_row(a, t, row0 + r, head + r * 2 * kActions, row_inputs(r), fb + r * kFeedback, row_env(r),
                      keep + r, true);
    }
  }

  // acc[g][r] += sum over k < in of x[r * stride + k] * wt[k, g * H + j] for the gates g = r, z, n, k in order;
  // wt is a transposed GRU weight [in, 3H].
  C10_HOST_DEVICE void gate_sums(const scalar_t* wt, const scalar_t* x, int64_t stride, int64_t in, int64_t j,
                                 scalar_t (*acc)[kMaxRows]) const {
    const int64_t size = a.hidden, gates = 3 * size;
    DEEPEP_INPUTS_UNROLL
    for (int64_t k = 0; k < in; ++k) {
      const scalar_t* w = wt + k * gates + j;
      const scalar_t w_r = w[0], w_z = w[size], w_n = w[2 * size];
      DEEPEP_ROWS_UNROLL
      for (int r = 0; r < kMaxRows; ++r) {
        if (r < count) {
          const scalar_t v = x[r * stride + k];
          acc[0][r] += v * w_r;
          acc[1][r] += v * w_z;
          acc[2][r] += v * w_n;
        }
      }
    }
  }

  // Thread j: unit j of every row's GRU cell (gates [r, z, n] as torch.nn.GRUCell), h_{t+1} = keep * h'.
  C10_HOST_DEVICE void gru(int64_t t, int tid, int threads) const {
    const int64_t size = a.hidden, width = kObs + size;
    for (int64_t j = tid; j < size; j += threads) {
      scalar_t gi[3][kMaxRows], gh[3][kMaxRows];
      DEEPEP_ROWS_UNROLL
      for (int r = 0; r < kMaxRows; ++r) gi[0][r] = gi[1][r] = gi[2][r] = gh[0][r] = gh[1][r] = gh[2][r] = scalar_t(0);
      gate_sums(a.gru_wiht, fb, kFeedback, kFeedback, j, gi);
      gate_sums(a.gru_whht, inputs + kObs, width, size, j, gh);
      DEEPEP_ROWS_UNROLL
      for (int r = 0; r < kMaxRows; ++r) {
        if (r < count) {
          const scalar_t row_gi[3] = {gi[0][r], gi[1][r], gi[2][r]}, row_gh[3] = {gh[0][r], gh[1][r], gh[2][r]};
          const scalar_t h_next = gru_unit(a, j, row_gi, row_gh, inputs[r * width + kObs + j], keep[r]);
          next_h[r * size + j] = h_next;
          a.states[(t * a.batch + row0 + r) * size + j] = h_next;
        }
      }
    }
  }

  // The next timestep's inputs: the CartPole states after the step (reset where done) and h_{t+1}.
  C10_HOST_DEVICE void commit(int tid, int threads) const {
    const int64_t width = kObs + a.hidden;
    for (int64_t i = tid; i < count * width; i += threads) {
      const int64_t r = i / width, k = i - r * width;
      row_inputs(r)[k] = k < kObs ? row_env(r)[k] : next_h[r * a.hidden + (k - kObs)];
    }
  }

  // The CartPole states and episode accumulators after the last timestep.
  C10_HOST_DEVICE void store(int tid, int threads) const { store_env(a, row0, count, env, tid, threads); }
};

// Throws c10::Error naming the argument when a shape, dtype or device does not fit (the Python wrapper checks
// the same before the op runs; these guard direct torch.ops callers).
void check_cartpole_rollout_inputs(const at::Tensor& state, const at::Tensor& episode_return,
                                   const at::Tensor& episode_length, const at::Tensor& hidden,
                                   const at::Tensor& uniforms, const at::Tensor& noise, at::TensorList weights,
                                   int64_t rows_per_block);

// (observations, feedback, states, actions, rewards, dones, terminateds, returns, next_state,
//  next_episode_return, next_episode_length)
using Outputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                           at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
template <typename scalar_t>
using Runner = std::function<void(const Args<scalar_t>&)>;

// The op for both devices: checks, contiguous inputs, allocated outputs, then the device's runner for the dtype.
Outputs cartpole_rollout_impl(const at::Tensor& state, const at::Tensor& episode_return,
                              const at::Tensor& episode_length, const at::Tensor& hidden, const at::Tensor& uniforms,
                              const at::Tensor& noise, at::TensorList weights, double logit_bound,
                              int64_t max_episode_steps, int64_t rows_per_block, const Runner<float>& run_float,
                              const Runner<double>& run_double);

}  // namespace deepep::rollout
