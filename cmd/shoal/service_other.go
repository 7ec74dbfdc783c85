//go:build !windows

package main

// runAsService reports whether this process ran as a service manager's service; only Windows'
// needs the process to speak its protocol (service_windows.go): systemd and launchd start the
// command line as it is and stop it with SIGTERM.
func runAsService() bool { return false }
