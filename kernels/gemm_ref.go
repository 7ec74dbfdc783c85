package kernels

// The reference multiplies: plain loops, one float32 accumulator per output element summed in
// k order, then added to c when acc. Slow and obviously right; the fast kernels are tested against
// them with a tolerance.

// RefMatMulNN is the reference for MatMulNN.
func RefMatMulNN(c, a, b []float32, m, k, n int, acc bool) {
	for i := 0; i < m; i++ {
		for j := 0; j < n; j++ {
			var s float32
			for p := 0; p < k; p++ {
				s += a[i*k+p] * b[p*n+j]
			}
			if acc {
				s += c[i*n+j]
			}
			c[i*n+j] = s
		}
	}
}

// RefMatMulNT is the reference for MatMulNT.
func RefMatMulNT(c, a, b []float32, m, k, n int, acc bool) {
	for i := 0; i < m; i++ {
		for j := 0; j < n; j++ {
			var s float32
			ar, br := a[i*k:i*k+k], b[j*k:j*k+k]
			for p := range ar {
				s += ar[p] * br[p]
			}
			if acc {
				s += c[i*n+j]
			}
			c[i*n+j] = s
		}
	}
}

// RefMatMulTN is the reference for MatMulTN.
func RefMatMulTN(c, a, b []float32, m, k, n int, acc bool) {
	for i := 0; i < m; i++ {
		for j := 0; j < n; j++ {
			var s float32
			for p := 0; p < k; p++ {
				s += a[p*m+i] * b[p*n+j]
			}
			if acc {
				s += c[i*n+j]
			}
			c[i*n+j] = s
		}
	}
}
