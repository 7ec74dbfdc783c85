//go:build !amd64 || purego || amd64.v3

package kernels

// Without the vector loops of vector_amd64.go the Go loops do all the work.

var geluVector, adamVector = false, false

func geluForwardVector(out, th, inp []float32) int { return 0 }

func geluBackwardVector(dinp, inp, th, dout []float32) int { return 0 }

func adamwVector(w, g, m, v []float32, decay, stepSize float32, sqrtBC2 float64, gradScale float32) int {
	return 0
}

var lnVector = false

func lnDxVector(di, x, w, d []float32, m, rs, dm, dnm float32) int { return 0 }

func lnParamsVector(db, dw, x, d []float32, m, rs float32) int { return 0 }

func lnRowVector(o, x, w, b []float32, m, rs float64) int { return 0 }

var axpyVector = false

func addScaledVec(dst, x []float32, s float32) int { return 0 }

func scaleToVec(dst, x []float32, s float32) int { return 0 }
