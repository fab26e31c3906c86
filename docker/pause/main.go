// The pod sandbox's pause process for the test node: it holds the pod's namespaces, reaps
// orphaned children (it is PID 1 of a pod that shares its PID namespace) and exits on TERM or
// INT. Built static (CGO_ENABLED=0) by scripts/images.sh; production nodes use their own.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	signals := make(chan os.Signal, 8)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT, syscall.SIGCHLD)
	for sig := range signals {
		if sig != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			pid, err := syscall.Wait4(-1, nil, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
