//go:build !amd64 || purego

package kernels

import "math"

var sumVector = false

func sumVec(dst, a, b []float32) int { return 0 }

func scaleMaxVec(x []float32, s float32) (int, float32) { return 0, float32(math.Inf(-1)) }

func scaleVec(x []float32, s float32) int { return 0 }
