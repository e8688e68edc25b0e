// The schema of every torchani_fast op, shared by registration.cpp (the one
// TORCH_LIBRARY) and the CUDA emulator's tests/cuda_emulation/emu_registration.cpp.
#pragma once

#define TORCHANI_FAST_AEV_ARGS                                                              \
  "Tensor species, Tensor pairs, Tensor diff_vectors, Tensor radial_eta, "                  \
  "Tensor radial_shifts, Tensor angular_eta, Tensor angular_zeta, Tensor angular_shifts, "  \
  "Tensor angular_sections, float radial_cutoff, float angular_cutoff, int num_species, "     \
  "int cutoff_kind=0, int cutoff_order=2, float cutoff_eps=1e-10"

namespace torchani_fast::schema {

constexpr const char* kNeighborPairs =
    "neighbor_pairs(Tensor species, Tensor coords, Tensor? cell, Tensor? pbc, float cutoff, "
    "bool cell_list) -> (Tensor pairs, Tensor images)";
constexpr const char* kNeighborPairsPadded =
    "neighbor_pairs_padded(Tensor species, Tensor coords, Tensor? cell, Tensor? pbc, "
    "float cutoff, bool cell_list, int max_pairs) -> (Tensor pairs, Tensor images, "
    "Tensor num_pairs)";
constexpr const char* kPairVectors =
    "pair_vectors(Tensor coords, Tensor pairs, Tensor? images, Tensor? cell) -> "
    "(Tensor diff_vectors, Tensor distances)";
constexpr const char* kPairVectorsBackward =
    "pair_vectors_backward(Tensor grad, Tensor pairs, int num_atoms) -> Tensor";
constexpr const char* kAev = "aev(" TORCHANI_FAST_AEV_ARGS ") -> Tensor";
constexpr const char* kAevBackward = "aev_backward(Tensor grad_aev, " TORCHANI_FAST_AEV_ARGS
                                     ") -> Tensor";
constexpr const char* kAevWithEdges =
    "aev_with_edges(" TORCHANI_FAST_AEV_ARGS ") -> (Tensor aev, Tensor edges)";
constexpr const char* kAevBackwardEdges =
    "aev_backward_edges(Tensor grad_aev, Tensor edges, " TORCHANI_FAST_AEV_ARGS ") -> Tensor";
constexpr const char* kAevJvp = "aev_jvp(Tensor tangent, " TORCHANI_FAST_AEV_ARGS ") -> Tensor";
constexpr const char* kAevDoubleBackward =
    "aev_double_backward(Tensor grad_aev, Tensor tangent, " TORCHANI_FAST_AEV_ARGS ") -> Tensor";
constexpr const char* kAevLocalDerivatives =
    "aev_local_derivatives(Tensor grad_aev, Tensor columns, " TORCHANI_FAST_AEV_ARGS
    ") -> (Tensor local_atoms, Tensor jacobian, Tensor curvature)";
constexpr const char* kEnsembleMlp =
    "ensemble_mlp(Tensor aev, Tensor atoms, int[] sizes, Tensor[] columns, Tensor[] first, "
    "Tensor[] packs, Tensor[] panels, int[] layers, int members, bool input_grad, "
    "bool zero_blocks_exact=False, int activation=0) -> (Tensor values, Tensor jacobian)";
constexpr const char* kEnsembleMlpBackward =
    "ensemble_mlp_backward(Tensor grad_values, Tensor atoms, int[] sizes, Tensor[] columns, "
    "Tensor jacobian, int features) -> Tensor";
constexpr const char* kEnsembleAtomic =
    "ensemble_atomic(Tensor aev, Tensor atoms, int[] sizes, Tensor[] columns, Tensor[] first, "
    "Tensor[] packs, Tensor[] panels, int[] layers, int members, bool zero_blocks_exact=False, "
    "int activation=0) -> Tensor";
constexpr const char* kEnsembleEnergies =
    "ensemble_energies(Tensor aev, Tensor atoms, int[] sizes, Tensor[] columns, Tensor[] first, "
    "Tensor[] packs, Tensor[] panels, int[] layers, int members, int molecules, int divisor, "
    "bool zero_blocks_exact=False, int activation=0) -> Tensor";
constexpr const char* kEnsembleTrain =
    "ensemble_train(Tensor aev, Tensor atoms, int[] sizes, Tensor[] columns, Tensor[] first, "
    "Tensor[] packs, int[] layers, int members, int small, int activation=0) -> Tensor";
// The networks of every element and member for all atoms at once, with weights
// stacked and zero-padded per layer (ensemble/ensemble_cuda.cu; CUDA only).
constexpr const char* kEnsembleDense =
    "ensemble_dense(Tensor aev, Tensor elem_idxs, Tensor[] weights, Tensor[] weights_t, "
    "Tensor[] biases, int activation=0, bool input_grad=False) -> (Tensor atomic, Tensor jacobian)";
// The float32/float64 activations and erf of the networks' kernels, elementwise (for tests).
constexpr const char* kSimdActivation =
    "simd_activation(Tensor x, int activation) -> (Tensor values, Tensor derivative)";
constexpr const char* kSimdErf = "simd_erf(Tensor x) -> Tensor";
constexpr const char* kGroupAtoms =
    "group_atoms(Tensor elem_idxs, int num_species, Tensor? aev=None, int radial_sublen=0, "
    "int split_min_atoms=0) -> (Tensor atoms, Tensor groups)";
constexpr const char* kWeightsState =
    "weights_state(Tensor[] params) -> (bool requires_grad, int fingerprint)";
constexpr const char* kFirstInvalidAtom = "first_invalid_atom(Tensor species, Tensor coords) -> int";
constexpr const char* kValidCell = "valid_cell(Tensor cell, Tensor pbc) -> bool";
constexpr const char* kConvertSpecies =
    "convert_species(Tensor atomic_nums, Tensor conv) -> (Tensor elem_idxs, int first_invalid)";

// Pair potentials (ops.h, pairpot/pairpot.h).
constexpr const char* kRepulsionXtb =
    "repulsion_xtb(Tensor elem_idxs, Tensor pairs, Tensor distances, Tensor? ghost_flags, "
    "bool atomic, Tensor y_ab, Tensor sqrt_alpha_ab, Tensor k_rep_ab, float angstrom_to_bohr, "
    "float cutoff, int cutoff_kind, int cutoff_order, float cutoff_eps, "
    "bool derivatives=False) -> (Tensor energies, Tensor derivs)";
constexpr const char* kDispersionD3 =
    "dispersion_d3(Tensor elem_idxs, Tensor pairs, Tensor distances, Tensor? ghost_flags, "
    "bool atomic, Tensor coeff6, Tensor coordnums_a, Tensor coordnums_b, Tensor covalent_radii, "
    "Tensor sqrt_charge_ab, Tensor cutoff_radii, float s6, float s8, float a1, float a2, "
    "float k1, float k2, float k3, float eps, float angstrom_to_bohr, float cutoff, "
    "int cutoff_kind, int cutoff_order, float cutoff_eps, bool derivatives=False) -> "
    "(Tensor energies, Tensor derivs)";
constexpr const char* kPairEnergiesBackward =
    "pair_energies_backward(Tensor grad_energies, Tensor derivs, Tensor pairs, "
    "Tensor elem_idxs, bool atomic) -> Tensor";

}  // namespace torchani_fast::schema

#undef TORCHANI_FAST_AEV_ARGS
