// parallel_for for the CPU ops: at::parallel_for's contract (f(begin, end) over [begin, end), chunks of at least
// `grain`, exceptions rethrown in the caller) without its barrier.
//
// An OpenMP region returns only once every thread of the team has run its share, so on a machine whose cores
// are shared, each region waits for a descheduled thread: up to a scheduler time slice per region, and a decode
// step has dozens (2-thread runs measured 10-20x slower under load, slower than one thread). Here chunks are
// claimed from an atomic counter by the calling thread and by helper threads as they arrive; the call returns
// once every claimed chunk is done, so a helper that is late only misses the work, it is never waited for.
// Helpers spin briefly after a job (decode steps issue them back to back), then sleep.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace pagedserve {
namespace detail {

struct Job {
  const std::function<void(int64_t, int64_t)>* f;
  int64_t begin, end, chunk;
  int64_t seats;  // helpers that may join
  std::atomic<int64_t> next;
  int users = 0;  // helpers inside (under WorkPool::mu_)
  std::exception_ptr error;
  std::mutex error_mu;

  Job(const std::function<void(int64_t, int64_t)>* f, int64_t begin, int64_t end, int64_t chunk, int64_t seats)
      : f(f), begin(begin), end(end), chunk(chunk), seats(seats), next(begin) {}

  void work() {
    for (int64_t b = next.fetch_add(chunk); b < end; b = next.fetch_add(chunk)) {
      try {
        (*f)(b, std::min(end, b + chunk));
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mu);
        if (!error) error = std::current_exception();
        next.store(end);  // claim nothing more
      }
    }
  }
};

inline thread_local bool in_pool_job = false;

class WorkPool {
 public:
  static WorkPool& instance() {
    static WorkPool* pool = new WorkPool();  // never destroyed: its helpers are detached and sleep at exit
    return *pool;
  }

  void run(int64_t begin, int64_t end, int64_t chunk, int64_t threads, const std::function<void(int64_t, int64_t)>& f) {
    Job job(&f, begin, end, chunk, threads - 1);
    {
      std::lock_guard<std::mutex> lock(mu_);
      while (static_cast<int64_t>(num_helpers_) < threads - 1) {
        std::thread(&WorkPool::helper, this).detach();
        ++num_helpers_;
      }
      job_ = &job;
      generation_.fetch_add(1);
    }
    wake_.notify_all();
    in_pool_job = true;
    job.work();
    in_pool_job = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      job_ = nullptr;  // no helper joins from here on; wait for those inside
      done_.wait(lock, [&] { return job.users == 0; });
    }
    if (job.error) std::rethrow_exception(job.error);
  }

 private:
  void helper() {
    in_pool_job = true;
    uint64_t seen = generation_.load();
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      lock.unlock();
      for (int spin = 0; spin < kSpins && generation_.load(std::memory_order_relaxed) == seen; ++spin)
        std::this_thread::yield();
      lock.lock();
      wake_.wait(lock, [&] { return generation_.load() != seen; });
      seen = generation_.load();
      Job* job = job_;
      if (job == nullptr || job->seats == 0) continue;
      --job->seats, ++job->users;
      lock.unlock();
      job->work();
      lock.lock();
      if (--job->users == 0) done_.notify_all();
    }
  }

  // Yields before sleeping: ~50 us when the core is free. Longer spins cost the main thread its core when
  // both threads share one (measured: 2,000 yields tripled the Python part of a step under load).
  static constexpr int kSpins = 100;
  std::mutex mu_;
  std::condition_variable wake_, done_;
  std::atomic<uint64_t> generation_{0};
  Job* job_ = nullptr;
  size_t num_helpers_ = 0;
};

}  // namespace detail

// at::parallel_for's signature and contract. Up to at::get_num_threads() threads (the caller's torch setting),
// chunks of max(grain, range / (4 x threads)) so a late helper leaves its share to the others in pieces.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const int64_t range = end - begin, threads = std::min<int64_t>(at::get_num_threads(), (range + grain - 1) / std::max<int64_t>(grain, 1));
  if (range <= 0) return;
  if (threads <= 1 || detail::in_pool_job || at::in_parallel_region()) {
    f(begin, end);
    return;
  }
  const int64_t chunk = std::max<int64_t>(grain, (range + 4 * threads - 1) / (4 * threads));
  const std::function<void(int64_t, int64_t)> fn = [&f](int64_t b, int64_t e) { f(b, e); };
  detail::WorkPool::instance().run(begin, end, chunk, threads, fn);
}

}  // namespace pagedserve
