package vulkan

import (
	"os"
	"sync"
	"testing"
)

// The tests share one device: opening one builds its pipelines again, which on lavapipe (LLVM
// compiling every kernel) costs more than most tests.
var (
	testOnce sync.Once
	testDev  *Device
	testErr  error
)

// device returns the shared test device, or skips the test when there is no Vulkan device
// (failing instead when SHOAL_VULKAN_REQUIRED=1, as CI sets it: there a missing driver is a
// broken environment, not a reason to pass).
func device(t testing.TB) *Device {
	t.Helper()
	testOnce.Do(func() { testDev, testErr = Open(0) })
	if testErr != nil {
		if os.Getenv("SHOAL_VULKAN_REQUIRED") == "1" {
			t.Fatalf("no Vulkan device, and SHOAL_VULKAN_REQUIRED=1: %v", testErr)
		}
		t.Skipf("no Vulkan device (set SHOAL_VULKAN_REQUIRED=1 to fail instead): %v", testErr)
	}
	return testDev
}

func TestMain(m *testing.M) {
	code := m.Run()
	if testDev != nil {
		testDev.Close()
	}
	os.Exit(code)
}

func TestDevices(t *testing.T) {
	d := device(t)
	infos, err := Devices()
	if err != nil {
		t.Fatal(err)
	}
	if len(infos) == 0 || infos[0].Name != d.Info().Name {
		t.Fatalf("Devices() = %+v, the open device is %+v", infos, d.Info())
	}
	for _, in := range infos {
		t.Logf("device %d: %s (%s), %d MiB, Vulkan %s", in.Index, in.Name, in.Type, in.MemoryBytes>>20, in.APIVersion)
	}
	if _, err := Open(len(infos)); err == nil {
		t.Fatalf("Open(%d) of %d devices succeeded", len(infos), len(infos))
	}
}
