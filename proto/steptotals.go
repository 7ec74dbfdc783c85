package proto

import (
	"fmt"
	"math"
	"sort"
)

// StepTotals combines the shards' reports of one step the way the single process computes them:
// CE is the mean over micro-batches, aux the mean over micro-batches of the sum over MoE blocks in
// block order, and the gradient norm the root of the per-tensor ‖g‖² summed in tensor-name order.
// Every float64 is added in the same order as model.Model.Gradients adds it, so a pipelined step
// reports bitwise the same numbers.
//
// It is defined here, beside StepReport, because it is only arithmetic on reports: the coordinator
// computes the clip factor with it, and client's in-process pipelines check against it, yet the
// coordinator must not import client, nor proto the model (doc.go).
func StepTotals(reports []*StepReport, M int) (ce, aux, norm float64, err error) {
	var auxes []BlockAux
	parts := map[string]float64{}
	var ces []float64
	for _, r := range reports {
		if len(r.CE) > 0 {
			if ces != nil {
				return 0, 0, 0, fmt.Errorf("two shards report cross-entropy")
			}
			ces = r.CE
		}
		auxes = append(auxes, r.Aux...)
		for name, v := range r.GradSq {
			// Replicas — of an expert, or pipeline replicas — report the same tensors: counted
			// once, and they must agree exactly, since all summed the same gradient tree.
			if old, dup := parts[name]; dup && old != v {
				return 0, 0, 0, fmt.Errorf("tensor %s reported by two shards with different norms (%v, %v): %w", name, old, v, ErrReplicasDiverged)
			}
			parts[name] = v
		}
	}
	if len(ces) != M {
		return 0, 0, 0, fmt.Errorf("cross-entropy of %d micro-batches, want %d", len(ces), M)
	}
	sort.Slice(auxes, func(i, j int) bool { return auxes[i].Block < auxes[j].Block })
	for j := 0; j < M; j++ {
		ce += ces[j]
		for _, a := range auxes {
			if len(a.Aux) != M {
				return 0, 0, 0, fmt.Errorf("block %d: aux of %d micro-batches, want %d", a.Block, len(a.Aux), M)
			}
			aux += a.Aux[j]
		}
	}
	return ce / float64(M), aux / float64(M), globalNorm(parts), nil
}

// globalNorm sums per-tensor squared norms in tensor-name (byte) order and returns the root. It is
// model.GlobalNorm, restated because proto imports the standard library only; the two must add in
// the same order, which client's TestStepTotalsNormMatchesModel checks bit for bit.
func globalNorm(parts map[string]float64) float64 {
	names := make([]string, 0, len(parts))
	for n := range parts {
		names = append(names, n)
	}
	sort.Strings(names)
	var s float64
	for _, n := range names {
		s += parts[n]
	}
	return math.Sqrt(s)
}
