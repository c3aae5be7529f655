// The registry of shared_group.h: Python and the backend hold integer handles, the groups live here.
#include "shared_group.h"

#include <unordered_map>

namespace accel {
namespace {

struct Registry {
  std::mutex mutex;
  std::unordered_map<int64_t, std::shared_ptr<SharedGroup>> groups;
  int64_t next_id = 1;
};

Registry& registry() {
  static auto* instance = new Registry();  // never destroyed: groups may be released after static destructors
  return *instance;
}

}  // namespace

int64_t register_group(const shm::Options& options) {
  auto group = translating([&] { return std::make_shared<SharedGroup>(options); });
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.groups.emplace(r.next_id, std::move(group));
  return r.next_id++;
}

std::shared_ptr<SharedGroup> find_group(int64_t handle) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto found = r.groups.find(handle);
  TORCH_CHECK(found != r.groups.end(), "accel shared-memory group: no group with handle ", handle,
              " (destroyed, or created in another process)");
  return found->second;
}

void release_group(int64_t handle) {
  std::shared_ptr<SharedGroup> removed;  // destroyed after the registry's lock is released
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto found = r.groups.find(handle);
  if (found == r.groups.end()) return;
  removed = std::move(found->second);
  r.groups.erase(found);
}

}  // namespace accel
