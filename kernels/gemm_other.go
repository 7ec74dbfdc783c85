//go:build !amd64 || purego

package kernels

// Without amd64 assembly (other architectures, wasm, or the purego build tag) only the portable
// kernel exists.
func availableImpls() []*gemmImpl { return []*gemmImpl{&goImpl} }
