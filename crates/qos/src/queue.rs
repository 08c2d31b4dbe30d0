//! Per-tenant software queues as intrusive lists over one pre-allocated node pool per thread.
//!
//! Why a pool: a thread may hold thousands of tenants, most with nothing queued; a ring per
//! tenant sized for its maximum depth would cost memory proportional to tenants × depth. One
//! pool sized for the thread's queued-request maximum, allocated when the scheduler starts,
//! bounds memory by what can actually be queued, and the hot path only takes and returns nodes.

use crate::cost::IoKind;

pub(crate) const NIL: u32 = u32::MAX;

/// One queued request: the dataplane's opaque token plus what the cost model needs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Node {
    pub(crate) request: u64,
    pub(crate) size_bytes: u32,
    pub(crate) kind: IoKind,
    pub(crate) tenant: u32,
    next: u32,
}

/// A FIFO of nodes in a [`Pool`]. The list does not own its nodes' memory; the pool does.
#[derive(Clone, Copy, Debug)]
pub(crate) struct List {
    head: u32,
    tail: u32,
    len: u32,
}

impl List {
    pub(crate) const EMPTY: List = List {
        head: NIL,
        tail: NIL,
        len: 0,
    };

    #[inline]
    pub(crate) fn len(&self) -> u32 {
        self.len
    }
}

#[derive(Debug)]
pub(crate) struct Pool {
    nodes: Vec<Node>,
    free: List,
}

impl Pool {
    pub(crate) fn new(capacity: u32) -> Pool {
        assert!(capacity > 0 && capacity < NIL, "pool capacity {capacity}");
        let nodes = (0..capacity)
            .map(|index| Node {
                request: 0,
                size_bytes: 0,
                kind: IoKind::Read,
                tenant: NIL,
                next: if index + 1 == capacity {
                    NIL
                } else {
                    index + 1
                },
            })
            .collect();
        Pool {
            nodes,
            free: List {
                head: 0,
                tail: capacity - 1,
                len: capacity,
            },
        }
    }

    #[inline]
    pub(crate) fn free_count(&self) -> u32 {
        self.free.len
    }

    #[inline]
    pub(crate) fn capacity(&self) -> u32 {
        self.nodes.len() as u32
    }

    /// Takes a free node, fills it and appends it to `list`; `false` when the pool is empty.
    #[inline]
    pub(crate) fn push_back(
        &mut self,
        list: &mut List,
        request: u64,
        size_bytes: u32,
        kind: IoKind,
        tenant: u32,
    ) -> bool {
        let Some(index) = self.take_free() else {
            return false;
        };
        let node = &mut self.nodes[index as usize];
        node.request = request;
        node.size_bytes = size_bytes;
        node.kind = kind;
        node.tenant = tenant;
        node.next = NIL;
        self.link_back(list, index);
        true
    }

    #[inline]
    pub(crate) fn front(&self, list: &List) -> Option<&Node> {
        (list.head != NIL).then(|| &self.nodes[list.head as usize])
    }

    /// Removes the first node of `list`, returns a copy and gives the node back to the pool.
    #[inline]
    pub(crate) fn pop_front(&mut self, list: &mut List) -> Option<Node> {
        let index = list.head;
        if index == NIL {
            return None;
        }
        let node = self.nodes[index as usize];
        list.head = node.next;
        list.len -= 1;
        if list.head == NIL {
            assert_eq!(list.len, 0, "list length out of step with its links");
            list.tail = NIL;
        }
        self.nodes[index as usize].tenant = NIL;
        self.nodes[index as usize].next = NIL;
        let mut free = self.free;
        self.link_back(&mut free, index);
        self.free = free;
        Some(node)
    }

    /// Puts a node popped a moment ago back at the front of `list` (the device refused it).
    pub(crate) fn push_front(&mut self, list: &mut List, node: Node) -> bool {
        let Some(index) = self.take_free() else {
            return false;
        };
        self.nodes[index as usize] = Node {
            next: list.head,
            ..node
        };
        list.head = index;
        if list.tail == NIL {
            list.tail = index;
        }
        list.len += 1;
        true
    }

    fn take_free(&mut self) -> Option<u32> {
        let index = self.free.head;
        if index == NIL {
            return None;
        }
        self.free.head = self.nodes[index as usize].next;
        self.free.len -= 1;
        if self.free.head == NIL {
            self.free.tail = NIL;
        }
        Some(index)
    }

    #[inline]
    fn link_back(&mut self, list: &mut List, index: u32) {
        self.nodes[index as usize].next = NIL;
        if list.tail == NIL {
            assert_eq!(list.head, NIL, "list has a head but no tail");
            list.head = index;
        } else {
            self.nodes[list.tail as usize].next = index;
        }
        list.tail = index;
        list.len += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fifo_order_and_bounded_pool() {
        let mut pool = Pool::new(3);
        let mut a = List::EMPTY;
        let mut b = List::EMPTY;
        assert!(pool.push_back(&mut a, 1, 4096, IoKind::Read, 0));
        assert!(pool.push_back(&mut b, 2, 4096, IoKind::Write, 1));
        assert!(pool.push_back(&mut a, 3, 8192, IoKind::Read, 0));
        assert!(!pool.push_back(&mut b, 4, 4096, IoKind::Read, 1));
        assert_eq!(pool.free_count(), 0);
        let first = pool.pop_front(&mut a).unwrap();
        assert_eq!(first.request, 1);
        assert!(pool.push_front(&mut a, first));
        assert_eq!(pool.front(&a).unwrap().request, 1);
        let order: Vec<u64> = std::iter::from_fn(|| pool.pop_front(&mut a))
            .map(|n| n.request)
            .collect();
        assert_eq!(order, vec![1, 3]);
        assert_eq!(a.len(), 0);
        assert_eq!(pool.free_count(), 2);
        assert_eq!(pool.pop_front(&mut b).map(|n| n.request), Some(2));
        assert_eq!(pool.free_count(), pool.capacity());
    }
}
