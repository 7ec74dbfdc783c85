//go:build windows

package main

import (
	"context"
	"os"
	"time"

	"golang.org/x/sys/windows/svc"
)

// runAsService runs the command line as a Windows service when the Service Control Manager
// started this process, and reports whether it did. Installed, for example, with
//
//	sc.exe create shoal-worker start= auto binPath= "C:\Program Files\Shoal\shoal.exe worker --config C:\ProgramData\Shoal\worker.conf"
//
// Stop and Shutdown end the command's context, which `shoal worker` takes as its first SIGTERM:
// it leaves at the job's next step boundary once the coordinator has a checkpoint of its shard
// (leaveWait at most, which the stop's wait hint tells the Service Control Manager).
func runAsService() bool {
	is, err := svc.IsWindowsService()
	if err != nil || !is {
		return false
	}
	if err := svc.Run("shoal", &service{args: os.Args[1:]}); err != nil {
		os.Exit(1)
	}
	return true
}

type service struct{ args []string }

func (s *service) Execute(_ []string, r <-chan svc.ChangeRequest, status chan<- svc.Status) (bool, uint32) {
	status <- svc.Status{State: svc.StartPending}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() {
		m := &Main{Stdout: os.Stdout, Stderr: os.Stderr}
		done <- m.Run(ctx, s.args)
	}()
	status <- svc.Status{State: svc.Running, Accepts: svc.AcceptStop | svc.AcceptShutdown}
	for {
		select {
		case err := <-done:
			if err != nil {
				return true, 1 // a service-specific exit code: the command failed
			}
			return false, 0
		case c := <-r:
			switch c.Cmd {
			case svc.Interrogate:
				status <- c.CurrentStatus
			case svc.Stop, svc.Shutdown:
				status <- svc.Status{State: svc.StopPending, WaitHint: uint32((leaveWait + 10*time.Second) / time.Millisecond)}
				cancel()
			}
		}
	}
}
