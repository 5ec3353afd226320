/// \file
/// \brief The halo exchange of context parallelism, without the transport: the messages a rank
/// packs for its peers and, from the messages it receives, its rows of the forward (out, lse)
/// and of the backward (dq, dk, dv), bitwise those of the single-process call.
///
/// A caller (torch.distributed, MPI) moves the messages: for each peer p, the rank sends
/// pack_halo_message(me, p, pass, ...) (ContextParallelRank::sent_elements(p, pass) elements)
/// and receives a buffer of received_elements(p, pass) elements, then calls halo_forward or
/// halo_backward with the received buffers. Message layout: poslsh/parallel/rank.hpp.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <array>
#include <string>
#include <type_traits>
#include <vector>

#include "poslsh/core/heads_view.hpp"
#include "poslsh/multihead/training.hpp"
#include "poslsh/parallel/rank.hpp"
#include "poslsh/parallel/slice.hpp"

namespace poslsh {

/// The tensors of one rank (its rows 0 .. m - 1, ContextParallelRank::rows()): q, k, v for the
/// forward; for the backward also out, dout and lse (H_q x m, row h at lse + h * lse_stride),
/// the forward's rows.
template <typename Scalar>
struct RankTensors {
  HeadsView<const Scalar> q, k, v, out, dout;
  const Scalar* lse = nullptr;
  Index lse_stride = 0;
};

/// A received message: a buffer of the elements the rank expects from one peer.
template <typename Scalar>
using MessageView = Eigen::Map<const Eigen::Matrix<Scalar, Eigen::Dynamic, 1>>;

namespace detail {

/// The read-only view of the same elements.
template <typename Scalar>
HeadsView<const Scalar> read_only(const HeadsView<Scalar>& view) {
  return {view.data, view.tokens, view.heads, view.dim, view.row_stride, view.head_stride};
}

/// The rows of one halo segment wherever they are (a rank's tensors, a message, a chunk's
/// buffers): K/V head views (head k_head) and, for the backward, the views of its G query
/// heads (from q_head) and their lse rows.
template <typename Element>
struct HaloRows {
  HeadsView<Element> k, v, q, out, dout;
  Element* lse = nullptr;
  Index lse_stride = 0;
  Index row = 0;     ///< the first row of the segment in the views
  Index k_head = 0;  ///< its K/V head in k and v
  Index q_head = 0;  ///< its first query head in q, out, dout and lse
};

/// Rows [from.row, + rows) of `heads` heads from from_head on to rows to.row .. of to_head ...
template <typename Scalar>
void copy_head_rows(const HeadsView<const Scalar>& from, Index from_row, Index from_head,
                    const HeadsView<Scalar>& to, Index to_row, Index to_head, Index rows,
                    Index heads) {
  for (Index r = 0; r < rows; ++r)
    for (Index h = 0; h < heads; ++h)
      std::copy_n(from.data + (from_head + h) * from.head_stride + (from_row + r) * from.row_stride,
                  from.dim,
                  to.data + (to_head + h) * to.head_stride + (to_row + r) * to.row_stride);
}

/// The `rows` rows of a segment of K/V head g copied from `from` to `to`: K and V, and for the
/// backward Q, out, dout and lse of the G query heads of g.
template <typename Scalar>
void copy_halo_rows(const HaloRows<const Scalar>& from, const HaloRows<Scalar>& to, Index rows,
                    Index group, HaloPass pass) {
  copy_head_rows(from.k, from.row, from.k_head, to.k, to.row, to.k_head, rows, 1);
  copy_head_rows(from.v, from.row, from.k_head, to.v, to.row, to.k_head, rows, 1);
  if (pass == HaloPass::forward) return;
  copy_head_rows(from.q, from.row, from.q_head, to.q, to.row, to.q_head, rows, group);
  copy_head_rows(from.out, from.row, from.q_head, to.out, to.row, to.q_head, rows, group);
  copy_head_rows(from.dout, from.row, from.q_head, to.dout, to.row, to.q_head, rows, group);
  for (Index h = 0; h < group; ++h)
    std::copy_n(from.lse + (from.q_head + h) * from.lse_stride + from.row, rows,
                to.lse + (to.q_head + h) * to.lse_stride + to.row);
}

/// The sections of one segment of `rows` rows in a message (the layout of rank.hpp): K/V head
/// 0 and query heads 0 .. G - 1 of views over the message.
template <typename Element>
HaloRows<Element> message_rows(Element* message, Index rows, const ContextParallelShapes& shapes,
                               HaloPass pass) {
  const Index d = shapes.head_dim, dv = shapes.value_dim, group = shapes.group();
  HaloRows<Element> at;
  at.k = interleaved_heads(message, rows, 1, d);
  at.v = interleaved_heads(message + rows * d, rows, 1, dv);
  if (pass == HaloPass::backward) {
    Element* next = message + rows * (d + dv);
    at.q = interleaved_heads(next, rows, group, d);
    at.out = interleaved_heads(next + rows * group * d, rows, group, dv);
    at.dout = interleaved_heads(next + rows * group * (d + dv), rows, group, dv);
    at.lse = next + rows * group * (d + 2 * dv);
    at.lse_stride = rows;
  }
  return at;
}

/// The rows of a segment in a rank's tensors.
template <typename Scalar>
HaloRows<const Scalar> tensor_rows(const RankTensors<Scalar>& tensors, const HaloSegment& segment,
                                   Index group) {
  return {tensors.k,          tensors.v,
          tensors.q,          tensors.out,
          tensors.dout,       tensors.lse,
          tensors.lse_stride, segment.source_row,
          segment.kv_head,    segment.kv_head * group};
}

/// Checks a rank's tensors against its shapes and rows: q, k, v (and for the backward out,
/// dout and lse).
template <typename Scalar>
void require_rank_tensors(const char* function, const ContextParallelRank& me,
                          const RankTensors<Scalar>& tensors, HaloPass pass) {
  static_assert(std::is_same_v<Scalar, float> || std::is_same_v<Scalar, double>,
                "context-parallel messages carry float or double rows");
  const ContextParallelShapes& s = me.shapes();
  const Index m = me.rows();
  require_view_shape(function, "q", tensors.q, m, s.query_heads, s.head_dim);
  require_view_shape(function, "k", tensors.k, m, s.kv_heads, s.head_dim);
  require_view_shape(function, "v", tensors.v, m, s.kv_heads, s.value_dim);
  if (pass == HaloPass::forward) return;
  require_view_shape(function, "out", tensors.out, m, s.query_heads, s.value_dim);
  require_view_shape(function, "dout", tensors.dout, m, s.query_heads, s.value_dim);
  require(m == 0 || (tensors.lse != nullptr && tensors.lse_stride >= m), function, "lse",
          tensors.lse_stride,
          [&] { return "must point at H_q rows of at least m = " + std::to_string(m); });
}

/// Checks the inputs of a halo pass (halo_forward, halo_backward): a plan with halos (a ring
/// plan has none), the rank's tensors (require_rank_tensors) and the received messages, one per
/// rank, of the expected sizes (the own entry unread).
template <typename Scalar>
void require_halo_inputs(const char* function, const ContextParallelRank& me,
                         const RankTensors<Scalar>& tensors,
                         const std::vector<MessageView<Scalar>>& messages, HaloPass pass) {
  require(!me.plan().ring, function, "me", "a ring plan",
          "must have halos (exact_tiled without a local window runs a ring)");
  require_rank_tensors(function, me, tensors, pass);
  require(static_cast<Index>(messages.size()) == me.ranks(), function, "messages", messages.size(),
          [&] { return "must hold one buffer per rank (" + std::to_string(me.ranks()) + ")"; });
  for (Index s = 0; s < me.ranks(); ++s) {
    const Index expected = me.received_elements(s, pass);
    const auto& message = messages[static_cast<std::size_t>(s)];
    require(s == me.rank() || message.size() == expected, function, "messages", message.size(),
            [&] {
              return "must hold " + std::to_string(expected) + " elements from rank " +
                     std::to_string(s);
            });
  }
}

/// Places every segment this rank reads in `pass` into the chunks' buffers `to[c]` (rows from
/// the chunk's span begin `span[c]`): its own rows from `tensors`, the others from the
/// messages, each message's segments in order.
template <typename Scalar>
void assemble_halo(const ContextParallelRank& me, const RankTensors<Scalar>& tensors,
                   const std::vector<MessageView<Scalar>>& messages, HaloPass pass,
                   const std::vector<HaloRows<Scalar>>& to, const std::vector<Index>& span) {
  const ContextParallelShapes& shapes = me.shapes();
  const Index group = shapes.group(), row_elements = halo_row_elements(shapes, pass);
  for (Index s = 0; s < me.ranks(); ++s) {
    const Scalar* message = messages[static_cast<std::size_t>(s)].data();
    for (const HaloSegment& segment : me.incoming(s, pass)) {
      const auto c = static_cast<std::size_t>(segment.chunk);
      const Index rows = segment.positions.size();
      HaloRows<Scalar> target = to[c];
      target.row = segment.positions.begin - span[c];
      target.k_head = segment.kv_head;
      target.q_head = segment.kv_head * group;
      if (s == me.rank()) {
        copy_halo_rows(tensor_rows(tensors, segment, group), target, rows, group, pass);
      } else {
        copy_halo_rows(message_rows(message, rows, shapes, pass), target, rows, group, pass);
        message += rows * row_elements;
      }
    }
  }
}

}  // namespace detail

/// Packs the message from this rank to `destination` in `pass` into `message`
/// (me.sent_elements(destination, pass) elements): for each segment of me.outgoing(destination,
/// pass) in order, its rows of `tensors` in the layout of rank.hpp (forward: k and v; backward
/// also q, out, dout and lse).
/// \throws std::invalid_argument naming a bad argument.
template <typename Scalar>
void pack_halo_message(const ContextParallelRank& me, Index destination, HaloPass pass,
                       const RankTensors<Scalar>& tensors, Scalar* message) {
  constexpr const char* function = "pack_halo_message";
  detail::require_rank_tensors(function, me, tensors, pass);
  const ContextParallelShapes& shapes = me.shapes();
  const Index group = shapes.group(), row_elements = halo_row_elements(shapes, pass);
  for (const HaloSegment& segment : me.outgoing(destination, pass)) {
    const Index rows = segment.positions.size();
    detail::copy_halo_rows(detail::tensor_rows(tensors, segment, group),
                           detail::message_rows(message, rows, shapes, pass), rows, group, pass);
    message += rows * row_elements;
  }
}

/// This rank's rows of the forward from its tensors (q, k, v) and the messages received from
/// every peer (messages[s]: me.received_elements(s, HaloPass::forward) elements from rank s; the
/// own entry is not read): for each chunk, the K and V rows of keys[g] of every K/V head g
/// assembled at key_span (zero elsewhere), then multihead_attention_slice of the chunk's queries
/// over them into its rows of out [m, H_q, d_v] and its columns of lse (H_q x m). Bitwise the
/// rows of multihead_attention on the whole sequence (the plan's keys hold every key of
/// nonzero weight). A ring plan has no halo: std::invalid_argument.
/// \throws std::invalid_argument naming a bad argument, before any head runs.
template <typename Scalar>
void halo_forward(const ContextParallelRank& me, const RankTensors<Scalar>& tensors,
                  const std::vector<MessageView<Scalar>>& messages, HeadsView<Scalar> out,
                  HeadsLseRef<Scalar> lse) {
  constexpr const char* function = "halo_forward";
  const ContextParallelShapes& s = me.shapes();
  detail::require_halo_inputs(function, me, tensors, messages, HaloPass::forward);
  detail::require_view_shape(function, "out", out, me.rows(), s.query_heads, s.value_dim);
  detail::require_lse_shape(function, lse, tensors.q);
  const auto& chunks = me.chunks();
  std::vector<std::vector<Scalar>> k_rows(chunks.size()), v_rows(chunks.size());
  std::vector<detail::HaloRows<Scalar>> buffers(chunks.size());
  std::vector<Index> span(chunks.size());
  for (std::size_t c = 0; c < chunks.size(); ++c) {
    const Index rows = chunks[c].key_span.size();
    k_rows[c].assign(static_cast<std::size_t>(rows * s.kv_heads * s.head_dim), Scalar(0));
    v_rows[c].assign(static_cast<std::size_t>(rows * s.kv_heads * s.value_dim), Scalar(0));
    buffers[c].k = interleaved_heads(k_rows[c].data(), rows, s.kv_heads, s.head_dim);
    buffers[c].v = interleaved_heads(v_rows[c].data(), rows, s.kv_heads, s.value_dim);
    span[c] = chunks[c].key_span.begin;
  }
  detail::assemble_halo(me, tensors, messages, HaloPass::forward, buffers, span);
  for (std::size_t c = 0; c < chunks.size(); ++c) {
    const ContextParallelChunk& chunk = chunks[c];
    const Index m = chunk.queries.size();
    if (m == 0) continue;
    multihead_attention_slice<Scalar>(
        detail::token_range(tensors.q, chunk.row, chunk.row + m), detail::read_only(buffers[c].k),
        detail::read_only(buffers[c].v), detail::token_range(out, chunk.row, chunk.row + m),
        lse.middleCols(chunk.row, m), chunk.queries.begin, chunk.key_span.begin, me.options());
  }
}

/// This rank's rows of the gradients from its tensors (q, k, v, out, dout, lse: the forward's
/// rows) and the messages of the backward received from every peer: for each chunk, the rows of
/// window[g] of every K/V head g (K, V and the Q, out, dout, lse of its query heads) assembled
/// at window_span (zero elsewhere), then multihead_attention_window_backward on them, whose
/// rows of the chunk's own positions go to dq [m, H_q, d], dk and dv [m, H_kv, d / d_v].
/// Bitwise the gradients of multihead_attention_backward on the whole sequence; nothing is sent
/// back. A ring plan has no halo: std::invalid_argument.
/// \throws std::invalid_argument naming a bad argument, before any head runs.
template <typename Scalar>
void halo_backward(const ContextParallelRank& me, const RankTensors<Scalar>& tensors,
                   const std::vector<MessageView<Scalar>>& messages, HeadsView<Scalar> dq,
                   HeadsView<Scalar> dk, HeadsView<Scalar> dv) {
  constexpr const char* function = "halo_backward";
  const ContextParallelShapes& s = me.shapes();
  detail::require_halo_inputs(function, me, tensors, messages, HaloPass::backward);
  const Index m_all = me.rows();
  detail::require_view_shape(function, "dq", dq, m_all, s.query_heads, s.head_dim);
  detail::require_view_shape(function, "dk", dk, m_all, s.kv_heads, s.head_dim);
  detail::require_view_shape(function, "dv", dv, m_all, s.kv_heads, s.value_dim);
  const auto& chunks = me.chunks();
  const std::size_t count = chunks.size();
  // Per chunk: K, V, Q, out, dout and lse over its window, then dq, dk, dv.
  std::vector<std::array<std::vector<Scalar>, 9>> storage(count);
  std::vector<detail::HaloRows<Scalar>> buffers(count);
  std::vector<Index> span(count);
  for (std::size_t c = 0; c < count; ++c) {
    const Index w = chunks[c].window_span.size();
    const Index widths[9] = {
        s.kv_heads * s.head_dim,     s.kv_heads * s.value_dim,    s.query_heads * s.head_dim,
        s.query_heads * s.value_dim, s.query_heads * s.value_dim, s.query_heads,
        s.query_heads * s.head_dim,  s.kv_heads * s.head_dim,     s.kv_heads * s.value_dim};
    for (std::size_t b = 0; b < 9; ++b)
      storage[c][b].assign(static_cast<std::size_t>(w * widths[b]), Scalar(0));
    detail::HaloRows<Scalar>& at = buffers[c];
    at.k = interleaved_heads(storage[c][0].data(), w, s.kv_heads, s.head_dim);
    at.v = interleaved_heads(storage[c][1].data(), w, s.kv_heads, s.value_dim);
    at.q = interleaved_heads(storage[c][2].data(), w, s.query_heads, s.head_dim);
    at.out = interleaved_heads(storage[c][3].data(), w, s.query_heads, s.value_dim);
    at.dout = interleaved_heads(storage[c][4].data(), w, s.query_heads, s.value_dim);
    at.lse = storage[c][5].data();
    at.lse_stride = w;
    span[c] = chunks[c].window_span.begin;
  }
  detail::assemble_halo(me, tensors, messages, HaloPass::backward, buffers, span);
  for (std::size_t c = 0; c < count; ++c) {
    const ContextParallelChunk& chunk = chunks[c];
    const Index m = chunk.queries.size(), w = chunk.window_span.size();
    if (m == 0) continue;
    const detail::HaloRows<Scalar>& at = buffers[c];
    const auto window_dq = interleaved_heads(storage[c][6].data(), w, s.query_heads, s.head_dim);
    const auto window_dk = interleaved_heads(storage[c][7].data(), w, s.kv_heads, s.head_dim);
    const auto window_dv = interleaved_heads(storage[c][8].data(), w, s.kv_heads, s.value_dim);
    multihead_attention_window_backward<Scalar>(
        detail::read_only(at.q), detail::read_only(at.k), detail::read_only(at.v),
        detail::read_only(at.out), Eigen::Map<const RowMatrix<Scalar>>(at.lse, s.query_heads, w),
        detail::read_only(at.dout), window_dq, window_dk, window_dv, chunk.window_span.begin,
        me.options());
    const Index own = chunk.queries.begin - chunk.window_span.begin;
    detail::copy_head_rows(detail::read_only(window_dq), own, 0, dq, chunk.row, 0, m,
                           s.query_heads);
    detail::copy_head_rows(detail::read_only(window_dk), own, 0, dk, chunk.row, 0, m, s.kv_heads);
    detail::copy_head_rows(detail::read_only(window_dv), own, 0, dv, chunk.row, 0, m, s.kv_heads);
  }
}

}  // namespace poslsh
