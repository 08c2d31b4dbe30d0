//! Thread scaling's rebalancing on a wake: which active threads hand how many of their
//! connections to the thread just woken, so that it does not serve only the connections
//! opened after the wake while the others keep theirs.
//!
//! Pure: the integrator passes each thread's open and movable connection counts and carries
//! the plan out through the same hand-over path as a park (a connection moves only once it is
//! between requests). Counts are the measure of load here: every connection of a kind that
//! moves is a client of the same server, and a count is exact where a busy share over a
//! window is not (the woken thread's share says nothing yet).
//!
//! The plan moves one connection at a time from the thread holding the most to the woken
//! one while that narrows the gap (a donor keeps more than the woken thread would hold) and
//! the donor stays at or above the even share (the active threads' total over their number,
//! rounded down: a donor capped by the step or by what can move does not make another give
//! below it), so the counts end within one of each other when enough connections can move
//! (repeated plans converge when a step bounds them). Bounded: at
//! most `step_max` connections leave one donor per plan (a wake does not stall a donor
//! behind a long queue of hand-overs; a later plan can move more).

/// One thread's connections as its driver last saw them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ThreadConnections {
    /// Open connections (every kind).
    pub open: u32,
    /// Of those, connections of a kind that can move (not an NVMe/TCP admin queue, not a TLS
    /// handshake, not already moving).
    pub movable: u32,
}

/// Part of a plan: `count` of `from`'s movable connections go to `to`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RebalanceMove {
    pub from: u16,
    pub to: u16,
    pub count: u32,
}

/// Connections one donor hands over per plan at most.
pub const REBALANCE_STEP_MAX: u32 = 64;

/// The moves that even out the connections of the active threads `0..active` onto `woken`
/// (one of them), at most `step_max` from each donor. Threads at or beyond `active` (parked)
/// neither give nor take. Empty when the counts are already even (within one).
pub fn plan_rebalance(
    threads: &[ThreadConnections],
    active: u16,
    woken: u16,
    step_max: u32,
) -> Vec<RebalanceMove> {
    let active = usize::from(active).min(threads.len());
    let woken_index = usize::from(woken);
    assert!(woken_index < active, "the woken thread is active");
    for thread in threads {
        assert!(thread.movable <= thread.open);
    }
    let mut open: Vec<u32> = threads[..active].iter().map(|t| t.open).collect();
    let mut movable: Vec<u32> = threads[..active].iter().map(|t| t.movable).collect();
    let mut given = vec![0u32; active];
    let total: u64 = open.iter().map(|&o| u64::from(o)).sum();
    let even_share = (total / active as u64) as u32;
    // At most `step_max` per donor: the loop ends within active × step_max iterations.
    loop {
        let donor = (0..active)
            .filter(|&thread| thread != woken_index && movable[thread] > 0)
            .filter(|&thread| open[thread] > even_share)
            .filter(|&thread| given[thread] < step_max)
            .max_by_key(|&thread| (open[thread], std::cmp::Reverse(thread)));
        let Some(donor) = donor else {
            break;
        };
        // Moving one narrows the gap only while the donor holds at least two more.
        if open[donor] < open[woken_index].saturating_add(2) {
            break;
        }
        open[donor] -= 1;
        movable[donor] -= 1;
        given[donor] += 1;
        open[woken_index] += 1;
    }
    let moves: Vec<RebalanceMove> = given
        .iter()
        .enumerate()
        .filter(|&(_, &count)| count > 0)
        .map(|(from, &count)| RebalanceMove {
            from: from as u16,
            to: woken,
            count,
        })
        .collect();
    // A donor never ends below the woken thread: the gap narrows, never flips.
    assert!(
        moves
            .iter()
            .all(|m| open[usize::from(m.from)] >= open[woken_index])
    );
    assert!(moves.iter().all(|m| m.count <= step_max && m.from != woken));
    moves
}

/// Spreading a tenant's connections over the threads (`[scaling] spread_tenants`): where
/// a connection of a tenant that has `counts[t]` connections on thread `t` (this one
/// included, on `here`) should move, if anywhere. Without it, where a tenant's connections
/// land is the kernel's `SO_REUSEPORT` hash of their ports: a flow of two connections has
/// both on one of two threads half the time, and then competes with the other flows for
/// one thread's CPU while the other thread's share goes to the others
/// (`docs/FAIRNESS.md`, "Spreading each flow").
///
/// The target is the active thread (`active`: bit `t` set for thread `t`) holding the
/// fewest of the tenant's connections, the lowest index on a tie; the connection moves only
/// when that leaves both threads within one of each other where they were two or more
/// apart, so repeated decisions converge and never move a connection back and forth.
pub fn spread_target(counts: &[u32], here: u16, active: u64) -> Option<u16> {
    let here_count = *counts.get(usize::from(here))?;
    assert!(
        here_count >= 1,
        "the deciding connection is counted on its thread"
    );
    let (target, fewest) = counts
        .iter()
        .enumerate()
        .take(64)
        .filter(|&(thread, _)| thread != usize::from(here) && active & (1u64 << thread) != 0)
        .min_by_key(|&(thread, &count)| (count, thread))
        .map(|(thread, &count)| (thread as u16, count))?;
    (here_count >= fewest + 2).then_some(target)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn threads(counts: &[(u32, u32)]) -> Vec<ThreadConnections> {
        counts
            .iter()
            .map(|&(open, movable)| ThreadConnections { open, movable })
            .collect()
    }

    fn after(threads: &[ThreadConnections], moves: &[RebalanceMove]) -> Vec<u32> {
        let mut open: Vec<u32> = threads.iter().map(|t| t.open).collect();
        for m in moves {
            open[usize::from(m.from)] -= m.count;
            open[usize::from(m.to)] += m.count;
        }
        open
    }

    #[test]
    fn two_threads_split_evenly() {
        let loads = threads(&[(10, 10), (0, 0)]);
        let moves = plan_rebalance(&loads, 2, 1, REBALANCE_STEP_MAX);
        assert_eq!(
            moves,
            vec![RebalanceMove {
                from: 0,
                to: 1,
                count: 5
            }]
        );
        assert_eq!(after(&loads, &moves), vec![5, 5]);
    }

    #[test]
    fn an_odd_count_ends_within_one() {
        let loads = threads(&[(7, 7), (0, 0)]);
        let moves = plan_rebalance(&loads, 2, 1, REBALANCE_STEP_MAX);
        assert_eq!(after(&loads, &moves), vec![4, 3]);
    }

    #[test]
    fn several_donors_give_from_the_fullest_first() {
        let loads = threads(&[(12, 12), (6, 6), (0, 0), (9, 9)]);
        // Thread 3 is parked: it neither gives nor takes.
        let moves = plan_rebalance(&loads, 3, 2, REBALANCE_STEP_MAX);
        let open = after(&loads, &moves);
        assert_eq!(open, vec![6, 6, 6, 9]);
        assert!(moves.iter().all(|m| m.from != 3 && m.to == 2));
    }

    #[test]
    fn only_movable_connections_move() {
        // Thread 0 holds 10, of which 2 can move (the rest TLS, an admin queue).
        let loads = threads(&[(10, 2), (0, 0)]);
        let moves = plan_rebalance(&loads, 2, 1, REBALANCE_STEP_MAX);
        assert_eq!(after(&loads, &moves), vec![8, 2]);
        // Another donor makes up for it.
        let loads = threads(&[(10, 1), (10, 10), (0, 0)]);
        let moves = plan_rebalance(&loads, 3, 2, REBALANCE_STEP_MAX);
        let open = after(&loads, &moves);
        assert_eq!(open, vec![9, 6, 5]);
    }

    #[test]
    fn each_donor_gives_at_most_a_step() {
        let loads = threads(&[(500, 500), (300, 300), (0, 0)]);
        let moves = plan_rebalance(&loads, 3, 2, 64);
        // Thread 0 gives a whole step; thread 1 only down to the even share (266).
        assert_eq!(
            moves,
            vec![
                RebalanceMove {
                    from: 0,
                    to: 2,
                    count: 64
                },
                RebalanceMove {
                    from: 1,
                    to: 2,
                    count: 34
                }
            ]
        );
        // Repeated plans on the counts reached converge to even.
        let mut loads = loads;
        for _ in 0..10 {
            let moves = plan_rebalance(&loads, 3, 2, 64);
            let open = after(&loads, &moves);
            loads = open
                .iter()
                .map(|&open| ThreadConnections {
                    open,
                    movable: open,
                })
                .collect();
        }
        let open: Vec<u32> = loads.iter().map(|t| t.open).collect();
        assert!(open.iter().max().unwrap_or(&0) - open.iter().min().unwrap_or(&0) <= 1);
        assert_eq!(open.iter().sum::<u32>(), 800);
    }

    #[test]
    fn nothing_moves_when_even_or_the_woken_thread_holds_more() {
        assert!(plan_rebalance(&threads(&[(3, 3), (3, 3)]), 2, 1, 64).is_empty());
        assert!(plan_rebalance(&threads(&[(4, 4), (3, 3)]), 2, 1, 64).is_empty());
        assert!(plan_rebalance(&threads(&[(1, 1), (9, 9)]), 2, 1, 64).is_empty());
        assert!(plan_rebalance(&threads(&[(0, 0), (0, 0)]), 2, 1, 64).is_empty());
        assert!(plan_rebalance(&threads(&[(9, 9), (0, 0)]), 2, 1, 0).is_empty());
    }

    /// Every constructed load: the total is kept, no donor gives more than it can move or the
    /// step, the gap never widens, and without bounds the active counts end within one.
    #[test]
    fn properties_over_constructed_loads() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move |bound: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % bound.max(1)
        };
        for _ in 0..2_000 {
            let count = 2 + next(7) as usize;
            let loads: Vec<ThreadConnections> = (0..count)
                .map(|_| {
                    let open = next(200) as u32;
                    let movable = next(u64::from(open) + 1) as u32;
                    ThreadConnections { open, movable }
                })
                .collect();
            let active = 2 + next(count as u64 - 1) as u16;
            let woken = next(u64::from(active)) as u16;
            let step_max = next(100) as u32;
            let moves = plan_rebalance(&loads, active, woken, step_max);
            let open = after(&loads, &moves);
            assert_eq!(
                open.iter().sum::<u32>(),
                loads.iter().map(|t| t.open).sum::<u32>()
            );
            for m in &moves {
                let donor = usize::from(m.from);
                assert!(m.count <= loads[donor].movable && m.count <= step_max);
                assert!(donor < usize::from(active) && m.to == woken);
                // A donor never ends below the woken thread, nor below the even share.
                assert!(
                    open[donor] >= open[usize::from(woken)],
                    "{loads:?} {moves:?}"
                );
                let active_total: u32 = loads[..usize::from(active)].iter().map(|t| t.open).sum();
                assert!(
                    open[donor] >= active_total / u32::from(active),
                    "{loads:?} {moves:?}"
                );
            }
            let fully_movable = loads.iter().all(|t| t.movable == t.open);
            if fully_movable && step_max >= 200 {
                let active_open = &open[..usize::from(active)];
                let max = active_open.iter().max().copied().unwrap_or(0);
                assert!(open[usize::from(woken)] + 1 >= max, "{loads:?} {moves:?}");
            }
        }
    }

    #[test]
    fn a_tenants_second_connection_on_a_thread_goes_to_the_thread_without_one() {
        assert_eq!(spread_target(&[2, 0], 0, 0b11), Some(1));
        assert_eq!(spread_target(&[1, 1], 1, 0b11), None);
        assert_eq!(spread_target(&[1, 0], 0, 0b11), None);
    }

    #[test]
    fn only_active_threads_take_a_spread_connection() {
        assert_eq!(spread_target(&[3, 0, 1], 0, 0b101), Some(2));
        assert_eq!(spread_target(&[3, 0, 0], 0, 0b001), None);
        assert_eq!(spread_target(&[5], 0, 0b1), None);
    }

    #[test]
    fn the_fewest_then_the_lowest_index_is_the_target() {
        assert_eq!(spread_target(&[4, 2, 1, 1], 0, 0b1111), Some(2));
        assert_eq!(spread_target(&[1, 4, 2, 3], 1, 0b1111), Some(0));
        // A thread the counts do not know of is not a target.
        assert_eq!(spread_target(&[2, 0], 5, 0b11), None);
    }

    #[test]
    fn connections_binding_one_after_another_end_within_one_per_thread() {
        // Each binds wherever the kernel put it, then moves if told: the counts never differ
        // by more than one, for any arrival pattern.
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        for threads in 1..=8usize {
            let active = (1u64 << threads) - 1;
            let mut counts = vec![0u32; threads];
            for _ in 0..200 {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let here = (state % threads as u64) as usize;
                counts[here] += 1;
                if let Some(to) = spread_target(&counts, here as u16, active) {
                    counts[here] -= 1;
                    counts[usize::from(to)] += 1;
                }
                let (min, max) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
                assert!(max - min <= 1, "{counts:?}");
            }
        }
    }
}
