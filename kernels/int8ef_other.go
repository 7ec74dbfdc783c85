//go:build !amd64 || purego

package kernels

// Without int8ef_amd64.s the scalar loops of Int8ErrorFeedback do all the work.

func int8AddVec(x, e []float32) int                            { return 0 }
func int8ScaleVec(x []float32) (float32, bool)                 { return 0, false }
func int8QuantVec(x, e []float32, codes []int8, s float32) int { return 0 }

func nesterovVec(g, v []float32, d []float64, lr, mu float64) int { return 0 }
