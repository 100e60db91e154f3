// Command etcd is etcd's own server entry point (go.etcd.io/etcd/server/v3/etcdmain), built from the
// release pinned in ../../go.mod for the local cluster. Debian's etcd 3.4 cannot serve the watch
// progress requests a v1.36 kube-apiserver needs for streaming lists; etcd 3.6 can.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
