from services.rollout.service import main

raise SystemExit(main())
