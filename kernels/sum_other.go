//go:build !amd64 || purego

package kernels

var sumVector = false

func sumVec(dst, a, b []float32) int { return 0 }
