package kernels

// geluConsts is the number of float32 constants of GELUForward's vector loops.
const geluConsts = 19

// geluConstants lays out GELUForward's constants for its vector loops, each as the float32 the
// Go loop converts it to (an untyped constant meeting a float32 is rounded to nearest even, as
// float32() rounds it), repeated eight times: 0.044715, geluScale, ±clampAt, ±0.0004, Tanh32's
// numerator P0…P6 and denominator Q0…Q3, 0.5 and 1.
func geluConstants() (c [geluConsts * 8]float32) {
	vals := [geluConsts]float32{
		geluCubic, geluScale, tanhClamp, -tanhClamp, tanhSmall, -tanhSmall,
		tanhP0, tanhP1, tanhP2, tanhP3, tanhP4, tanhP5, tanhP6,
		tanhQ0, tanhQ1, tanhQ2, tanhQ3,
		0.5, 1,
	}
	for i, v := range vals {
		for j := range 8 {
			c[i*8+j] = v
		}
	}
	return c
}
