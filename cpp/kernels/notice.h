// The host side of the HeaderNotice protocol (kernels.h): the CPU twin's post and the reader a
// whole call alone waits with. Host code only (the device post is in cuda_kernels.cu).
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>

#include "kernels.h"

namespace compcomm::kernels {

enum class NoticeState : int { kPending = 0, kReady = 1, kTorn = 2 };

// Post `h` under tag `seq`, in the order the device twin uses: begin, header, tag.
inline void post_notice_host(HeaderNotice* n, const ExchangeHeader& h, uint64_t seq) {
  *static_cast<volatile uint64_t*>(&n->begin) = seq;
  std::atomic_thread_fence(std::memory_order_release);  // begin before any header byte
  std::memcpy(&n->header, &h, sizeof(ExchangeHeader));
  std::atomic_thread_fence(std::memory_order_release);  // the header before the tag
  *static_cast<volatile uint64_t*>(&n->tag) = seq;
}

// kPending: call `seq` has not posted yet (its tag is not there). kReady: `*out` is its header, whole.
// kTorn: its tag is there but the header was (being) overwritten by another writer -- a late
// worker kernel of an earlier call on the same notice -- so `*out` cannot be trusted.
inline NoticeState read_notice(const HeaderNotice* n, uint64_t seq, ExchangeHeader* out) {
  const volatile uint64_t* tag = &n->tag;
  if (*tag != seq) return NoticeState::kPending;
  std::atomic_thread_fence(std::memory_order_acquire);  // the header after the tag
  std::memcpy(out, const_cast<const ExchangeHeader*>(&n->header), sizeof(ExchangeHeader));
  std::atomic_thread_fence(std::memory_order_acquire);  // begin (and tag again) after the header
  const uint64_t begin = *static_cast<const volatile uint64_t*>(&n->begin);
  return begin == seq && *tag == seq ? NoticeState::kReady : NoticeState::kTorn;
}

}  // namespace compcomm::kernels
