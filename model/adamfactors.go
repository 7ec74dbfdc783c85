package model

// AdamWFactors are the scalars of step t's AdamW update of a tensor of the given shape, as Update
// passes them to kernels.AdamW: the weight-decay factor, lr/bc1, and √bc2. An auditor uses them to
// check that a worker's parameters follow from its own Adam moments (package audit).
func AdamWFactors(shape []int, t int, lr, weightDecay float64) (decay, stepSize float32, sqrtBC2 float64) {
	stepSize, sqrtBC2 = adamwStep(t, lr)
	return adamwDecay(Spec{Shape: shape}, lr, weightDecay), stepSize, sqrtBC2
}
