//! The online planner's host count and the model's validation errors.

use pliant_placement::plan::{check, AttemptOutcome};
use pliant_placement::{milp, ModelError, Placement, PlanError, Problem};

fn problem(loads: &[f64], bytes: u64, max_hosts: usize, k: usize) -> Problem {
    pliant_placement::instances::uniform(loads, bytes, max_hosts, k)
}

#[test]
fn adds_a_host_when_n_hosts_cannot_fit_the_load() {
    // 180 units of load: the bound says 2 hosts, but no two 60s share a host of 100.
    let mut p = problem(&[60.0, 60.0, 60.0], 10, 5, 0);
    p.current = Some(Placement::new(vec![vec![0], vec![0], vec![1]]));
    let plan = milp::plan_online(&p, &milp::MilpOptions::default()).unwrap();
    check(&p, &plan).unwrap();
    assert_eq!(plan.attempts[0].hosts, 2);
    assert_eq!(plan.attempts[0].outcome, AttemptOutcome::Infeasible);
    assert_eq!(plan.attempts.last().unwrap().hosts, 3);
    assert_eq!(plan.steps[0].hosts_used, 3);
    // One copy leaves host 0, none of the others move.
    assert_eq!(plan.bytes_moved, 10);
    assert_eq!(plan.steps[0].moves.len(), 1);
    assert_eq!(plan.steps[0].moves[0].from, Some(0));
}

#[test]
fn scales_in_when_the_load_drops() {
    let mut p = problem(&[10.0, 10.0, 10.0, 10.0], 10, 4, 1);
    p.current = Some(Placement::new(vec![
        vec![0, 1],
        vec![2, 3],
        vec![0, 2],
        vec![1, 3],
    ]));
    let plan = milp::plan_online(&p, &milp::MilpOptions::default()).unwrap();
    check(&p, &plan).unwrap();
    assert_eq!(plan.steps[0].hosts_used, 2);
}

#[test]
fn refuses_when_the_pool_is_too_small() {
    let p = problem(&[60.0, 60.0, 60.0], 10, 2, 0);
    let err = milp::plan_online(&p, &milp::MilpOptions::default()).unwrap_err();
    assert!(
        matches!(err, PlanError::NoFeasiblePlacement { max_hosts: 2, .. }),
        "{err}"
    );
}

#[test]
fn validation_names_what_is_wrong() {
    let ok = problem(&[10.0, 20.0], 10, 3, 1);
    assert_eq!(ok.validate(), Ok(()));
    let mut p = ok.clone();
    p.k = 3;
    assert!(matches!(
        p.validate(),
        Err(ModelError::NotEnoughHosts {
            copies: 4,
            max_hosts: 3,
            ..
        })
    ));
    let mut p = ok.clone();
    p.partitions[1].bytes = 1001;
    assert!(matches!(
        p.validate(),
        Err(ModelError::PartitionTooBig { partition: 1, .. })
    ));
    let mut p = ok.clone();
    p.partitions[0].load[0] = 100.5;
    assert!(matches!(
        p.validate(),
        Err(ModelError::PartitionTooHot {
            partition: 0,
            step: 0,
            ..
        })
    ));
    let mut p = ok.clone();
    p.partitions[0].load[0] = f64::NAN;
    assert!(matches!(
        p.validate(),
        Err(ModelError::BadLoad { partition: 0, .. })
    ));
    let mut p = ok.clone();
    p.partitions[1].load.push(1.0);
    assert!(matches!(
        p.validate(),
        Err(ModelError::HorizonMismatch {
            partition: 1,
            len: 2,
            expected: 1
        })
    ));
    let mut p = ok.clone();
    p.max_hosts = 0;
    assert_eq!(p.validate(), Err(ModelError::NoHosts));
    let mut p = ok.clone();
    p.host.cpu_capacity = 0.0;
    assert!(matches!(p.validate(), Err(ModelError::BadCpuCapacity(_))));
    let mut p = ok.clone();
    p.costs.epsilon = -1.0;
    assert!(matches!(
        p.validate(),
        Err(ModelError::BadCost {
            name: "epsilon",
            ..
        })
    ));
    let mut p = ok.clone();
    p.current = Some(Placement {
        copies: vec![vec![0, 1]],
    });
    assert!(matches!(
        p.validate(),
        Err(ModelError::CurrentLength {
            len: 1,
            expected: 2
        })
    ));
    p.current = Some(Placement {
        copies: vec![vec![0, 1], vec![2]],
    });
    assert!(matches!(
        p.validate(),
        Err(ModelError::CurrentCopies {
            partition: 1,
            len: 1,
            copies: 2
        })
    ));
    p.current = Some(Placement {
        copies: vec![vec![0, 1], vec![2, 2]],
    });
    assert!(matches!(
        p.validate(),
        Err(ModelError::CurrentDuplicate {
            partition: 1,
            host: 2
        })
    ));
    p.current = Some(Placement {
        copies: vec![vec![0, 1], vec![2, 3]],
    });
    assert!(matches!(
        p.validate(),
        Err(ModelError::CurrentHostOutOfRange {
            partition: 1,
            host: 3,
            ..
        })
    ));
    let mut p = ok;
    p.partitions[0].load.push(1.0);
    p.partitions[1].load.push(1.0);
    let err = milp::plan_online(&p, &milp::MilpOptions::default()).unwrap_err();
    assert_eq!(err, PlanError::Model(ModelError::NotASnapshot(2)));
}
